#include "checkpoint/torch_file_writer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/util/StringUtil.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/internal/zip_writer.h"
#include "checkpoint/libtorch_compat.h"
#include "checkpoint/stored_zip.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "torch_file_writer writes storages as they are in memory and calls them little-endian"
#endif

namespace dtrain::checkpoint {
namespace {

using internal::kMax32;
using internal::put_le;
using internal::ZipWriter;

constexpr size_t kMaxDepth =
    200;  // far beyond any state dict; keeps the recursion within small stacks
constexpr size_t kBatchSize = 1000;  // CPython's pickler: items per MARK ... SETITEMS / APPENDS

// The storage class Python's torch.save names for each dtype (torch/storage.py).
const char* storage_class(at::ScalarType t) {
  static constexpr std::pair<at::ScalarType, const char*> kClasses[] = {
      {at::kFloat, "FloatStorage"},
      {at::kDouble, "DoubleStorage"},
      {at::kHalf, "HalfStorage"},
      {at::kBFloat16, "BFloat16Storage"},
      {at::kLong, "LongStorage"},
      {at::kInt, "IntStorage"},
      {at::kShort, "ShortStorage"},
      {at::kChar, "CharStorage"},
      {at::kByte, "ByteStorage"},
      {at::kBool, "BoolStorage"},
      {at::kComplexFloat, "ComplexFloatStorage"},
      {at::kComplexDouble, "ComplexDoubleStorage"}};
  for (const auto& [type, name] : kClasses) {
    if (type == t) return name;
  }
  return nullptr;
}

// Offset of the first byte that is not well-formed UTF-8 (strict: no surrogates, no overlongs),
// or npos. Python decodes BINUNICODE strictly enough to fail on anything else.
size_t invalid_utf8_at(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0, n = s.size(); i < n;) {
    const unsigned c = p[i];
    size_t len = c < 0x80           ? 1
                 : (c >> 5) == 0x6  ? 2
                 : (c >> 4) == 0xe  ? 3
                 : (c >> 3) == 0x1e ? 4
                                    : 0;
    if (len == 0 || i + len > n) return i;
    uint32_t cp = len == 1 ? c : c & (0x7f >> len);
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return i;
    i += len;
  }
  return std::string::npos;
}

// Pickle protocol 2 as CPython's C pickler writes it for torch.save, memo and batching included.
class Pickler {
 public:
  struct Storage {
    std::string key;
    const char* data;
    size_t nbytes;
    at::Tensor host_copy;  // owns `data` when the storage is not on the CPU; undefined otherwise
  };

  absl::Status dump(const c10::IValue& v) {
    out_ = "\x80\x02";  // PROTO 2
    if (absl::Status s = value(v); !s.ok()) return s;
    out_.push_back('.');  // STOP
    return absl::OkStatus();
  }
  const std::string& bytes() const { return out_; }
  const std::vector<Storage>& storages() const { return storages_; }

 private:
  // Where the value being written sits, joined only when an error needs it.
  struct PathPart {
    const c10::IValue* key;  // dict key, or null for a list/tuple index
    size_t index;
  };
  static std::string key_text(const c10::IValue& key) {
    if (key.isString()) return key.toStringRef();
    if (key.isInt()) return std::to_string(key.toInt());
    if (key.isBool()) return key.toBool() ? "True" : "False";
    if (key.isDouble()) {
      std::string text = absl::StrCat(key.toDouble());
      return text.find_first_of(".en") == std::string::npos ? text + ".0"
                                                            : text;  // as Python prints it
    }
    return absl::StrCat("<", key.tagKind(), " key>");
  }
  // The int a dict key equals in Python (ints, bools, integral floats), else nullopt.
  static std::optional<int64_t> integral_key(const c10::IValue& key) {
    if (key.isInt()) return key.toInt();
    if (key.isBool()) return key.toBool() ? 1 : 0;
    if (!key.isDouble()) return std::nullopt;
    const double d = key.toDouble();
    if (!(d == std::floor(d) && d >= -9.2e18 && d <= 9.2e18)) return std::nullopt;
    return static_cast<int64_t>(d);
  }
  std::string path() const {
    if (path_.empty()) return "(root)";
    std::string p;
    for (const PathPart& part : path_) {
      if (!p.empty()) p += "/";
      p += part.key == nullptr ? std::to_string(part.index) : key_text(*part.key);
    }
    return p;
  }
  absl::Status error(const std::string& what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write '", path(), "' as torch.save would: ", what));
  }

  void op(char code, uint64_t arg, int bytes) {
    out_.push_back(code);
    put_le(out_, arg, bytes);
  }
  void memo_put() {  // BINPUT / LONG_BINPUT
    const uint32_t i = next_memo_++;
    i < 256 ? op('q', i, 1) : op('r', i, 4);
  }
  void memo_get(uint32_t i) { i < 256 ? op('h', i, 1) : op('j', i, 4); }  // BINGET / LONG_BINGET
  // Python memoizes str by identity; equal strings here are one memo entry (immutable, so the
  // loaded value is the same), which is what a Python-loaded-and-resaved value gives too.
  void str(const std::string& s) {
    if (auto it = str_memo_.find(s); it != str_memo_.end()) return memo_get(it->second);
    op('X', s.size(), 4);  // BINUNICODE
    out_ += s;
    str_memo_.emplace(s, next_memo_);
    memo_put();
  }
  void global(const char* module, const char* name) {
    std::string key = absl::StrCat(module, "\n", name, "\n");
    if (auto it = global_memo_.find(key); it != global_memo_.end()) return memo_get(it->second);
    out_.push_back('c');  // GLOBAL
    out_ += key;
    global_memo_.emplace(std::move(key), next_memo_);
    memo_put();
  }
  void integer(int64_t v) {
    if (v >= 0 && v < 65536) {
      v < 256 ? op('K', v, 1) : op('M', v, 2);  // BININT1 / BININT2
    } else if (v >= std::numeric_limits<int32_t>::min() &&
               v <= std::numeric_limits<int32_t>::max()) {
      op('J', static_cast<uint32_t>(static_cast<int32_t>(v)), 4);  // BININT
    } else {
      // LONG1, always 8 bytes: CPython writes the fewest bytes, LibTorch's unpickler reads only 8.
      op('\x8a', 8, 1);
      put_le(out_, static_cast<uint64_t>(v), 8);
    }
  }
  void floating(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, 8);
    out_.push_back('G');  // BINFLOAT, big-endian
    for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  }
  // A fresh tuple (Python: EMPTY_TUPLE unmemoized; TUPLE1-3 or MARK ... TUPLE, then memoized).
  template <typename Element>
  absl::Status tuple(size_t n, const void* identity, Element&& element) {
    if (n == 0) {
      out_.push_back(')');
      return absl::OkStatus();
    }
    if (n > 3) out_.push_back('(');
    for (size_t i = 0; i < n; ++i) {
      if (absl::Status s = element(i); !s.ok()) return s;
    }
    out_.push_back(n == 1 ? '\x85' : n == 2 ? '\x86' : n == 3 ? '\x87' : 't');
    if (identity != nullptr) obj_memo_.emplace(identity, next_memo_);
    memo_put();
    return absl::OkStatus();
  }
  void int_tuple(c10::IntArrayRef xs) {
    (void)tuple(xs.size(), nullptr, [&](size_t i) {
      integer(xs[i]);
      return absl::OkStatus();
    });
  }

  absl::Status value(const c10::IValue& v) {
    if (path_.size() > kMaxDepth)
      return error(absl::StrCat("nested deeper than ", kMaxDepth, " levels"));
    if (v.isNone()) {
      out_.push_back('N');
    } else if (v.isBool()) {
      out_.push_back(v.toBool() ? '\x88' : '\x89');  // NEWTRUE / NEWFALSE
    } else if (v.isInt()) {
      integer(v.toInt());
    } else if (v.isDouble()) {
      floating(v.toDouble());
    } else if (v.isString()) {
      const std::string& s = v.toStringRef();
      if (size_t at = invalid_utf8_at(s); at != std::string::npos) {
        return error(
            absl::StrCat("the string is not valid UTF-8 (byte ", at, " of ", s.size(),
                         "), which Python cannot load as str; keep bytes in a uint8 tensor"));
      }
      if (s.size() > kMax32) return error("a string of 4 GiB or more needs pickle protocol 4");
      str(s);
    } else if (v.isTensor()) {
      return tensor(v.toTensor());
    } else if (v.isTuple() || v.isList() || v.isGenericDict()) {
      if (auto it = obj_memo_.find(v.internalToPointer()); it != obj_memo_.end()) {
        memo_get(it->second);  // the same object again: Python gets one object, as from torch.save
        return absl::OkStatus();
      }
      return v.isTuple() ? tuple_value(v) : v.isList() ? list_value(v) : dict_value(v);
    } else {
      return error(absl::StrCat("a ", v.tagKind(),
                                " is not a plain state-dict value (write tensors, dicts, "
                                "lists, tuples, str, int, float, bool or None)"));
    }
    return absl::OkStatus();
  }

  absl::Status tuple_value(const c10::IValue& v) {
    const void* identity = v.internalToPointer();
    if (!tuples_in_progress_.insert(identity).second) {
      return error(
          "the tuple contains itself; Python's weights-only loader cannot read recursive tuples");
    }
    const auto& elements = v.toTupleRef().elements();
    absl::Status s = tuple(elements.size(), identity, [&](size_t i) {
      path_.push_back({nullptr, i});
      absl::Status st = value(elements[i]);
      if (st.ok()) path_.pop_back();
      return st;
    });
    tuples_in_progress_.erase(identity);
    return s;
  }

  absl::Status list_value(const c10::IValue& v) {
    out_.push_back(']');  // EMPTY_LIST, memoized before its items (recursive lists work)
    obj_memo_.emplace(v.internalToPointer(), next_memo_);
    memo_put();
    const c10::List<c10::IValue> list = v.toList();
    const size_t n = list.size();
    if (n == 0) return absl::OkStatus();
    // CPython's batch_list_exact: batches of MARK, up to 1000 items, APPENDS. One item, which
    // CPython writes as X APPEND, gets MARK X APPENDS: LibTorch's unpickler has no APPEND.
    out_.push_back('(');
    for (size_t i = 0; i < n; ++i) {
      path_.push_back({nullptr, i});
      if (absl::Status s = value(list.get(i)); !s.ok()) return s;
      path_.pop_back();
      if ((i + 1) % kBatchSize == 0 || i + 1 == n) out_ += i + 1 < n ? "e(" : "e";  // APPENDS
    }
    return absl::OkStatus();
  }

  absl::Status dict_value(const c10::IValue& v) {
    out_.push_back('}');  // EMPTY_DICT
    obj_memo_.emplace(v.internalToPointer(), next_memo_);
    memo_put();
    const c10::impl::GenericDict dict = v.toGenericDict();
    const size_t n = dict.size();
    if (n == 0) return absl::OkStatus();
    // CPython's batch_dict_exact: MARK, up to 1000 items, SETITEMS, again while the last batch
    // was full (so 1000 items end with an empty batch). One item, which CPython writes as K V
    // SETITEM, gets MARK K V SETITEMS: the same dict for every reader, and LibTorch 1.13's
    // unpickler (dtrain's load_state there) has no SETITEM.
    out_.push_back('(');
    size_t i = 0;
    std::unordered_map<int64_t, const c10::IValue*> numeric_keys;  // Python: 1 == 1.0 == True
    for (const auto& kv : dict) {
      if (std::optional<int64_t> k = integral_key(kv.key())) {
        if (auto [it, fresh] = numeric_keys.emplace(*k, &kv.key()); !fresh) {
          return error(
              absl::StrCat("its keys ", key_text(*it->second), " and ", key_text(kv.key()),
                           " are one key in a Python dict, which would keep only the last value"));
        }
      }
      path_.push_back({&kv.key(), i});
      absl::Status s = value(kv.key());
      if (s.ok()) s = value(kv.value());
      if (!s.ok()) return s;
      path_.pop_back();
      ++i;
      if (i % kBatchSize == 0) out_ += "u(";
    }
    out_.push_back('u');  // SETITEMS
    return absl::OkStatus();
  }

  absl::Status tensor(const at::Tensor& t) {
    if (!t.defined()) {
      out_.push_back('N');  // no undefined tensors in Python; state dicts use None there
      return absl::OkStatus();
    }
    if (auto it = obj_memo_.find(t.unsafeGetTensorImpl()); it != obj_memo_.end()) {
      memo_get(it->second);
      return absl::OkStatus();
    }
    const char* cls = storage_class(t.scalar_type());
    if (t.is_quantized() || t.layout() != at::kStrided || t.is_nested()) {
      return error(absl::StrCat("only dense (strided) tensors are written; this one is ",
                                t.toString(), " with layout ", c10::str(t.layout()),
                                t.is_nested() ? " (nested)" : "",
                                "; convert it (to_dense(), dequantize()) first"));
    }
    if (t.is_meta())
      return error("a meta tensor has no data to save; materialise it on the CPU or a GPU first");
    if (cls == nullptr)
      return error(absl::StrCat("dtype ", c10::toString(t.scalar_type()), " has no storage class"));
    if (t.is_conj() || t.is_neg())
      return error("the tensor has its conj/neg bit set; call resolve_conj()/resolve_neg()");
    if (has_dimension_names(t))
      return error("named tensors cannot be saved (torch.save refuses them too); rename(None)");
    if (!t.has_storage())
      return error("the tensor has no storage (a wrapper or functional tensor)");
    const c10::Storage& storage = t.storage();
    const size_t nbytes = storage.nbytes();
    const size_t itemsize = t.element_size();
    if (nbytes % itemsize != 0) {
      return error(absl::StrCat("its storage has ", nbytes, " bytes, not a whole number of ",
                                c10::toString(t.scalar_type()), " elements; save a clone()"));
    }
    const c10::StorageImpl* impl =
        storage.unsafeGetStorageImpl();  // the original: views of a CUDA one share too
    auto it = storage_keys_.find(impl);
    if (it == storage_keys_.end()) {
      const std::string key = std::to_string(storages_.size());
      if (absl::Status s = add_storage(t, storage, nbytes, key); !s.ok()) return s;
      it = storage_keys_.emplace(impl, StorageKey{key, t.scalar_type(), path()}).first;
    } else if (it->second.dtype != t.scalar_type()) {
      return error(absl::StrCat("it views the storage of '", it->second.first_path, "' as ",
                                c10::toString(t.scalar_type()), ", that one as ",
                                c10::toString(it->second.dtype),
                                "; torch.save refuses this too: save a clone() of one"));
    }
    global("torch._utils", "_rebuild_tensor_v2");
    out_ +=
        "((";  // the arguments' MARK, the persistent id's: ('storage', torch.<T>Storage, key, 'cpu', numel)
    str("storage");
    global("torch", cls);
    str(it->second.key);
    str("cpu");  // also for CUDA tensors (PyTorch: 'cuda:0'), so that the file loads without a GPU
    integer(static_cast<int64_t>(nbytes / itemsize));
    out_ += 't';
    memo_put();
    out_ += 'Q';  // BINPERSID
    integer(t.storage_offset());
    int_tuple(t.sizes());
    int_tuple(t.strides());
    out_.push_back(t.requires_grad() ? '\x88' : '\x89');
    global("collections", "OrderedDict");  // backward_hooks = OrderedDict()
    out_ += ")R";
    memo_put();
    out_.push_back('t');  // the six arguments
    memo_put();
    out_.push_back('R');  // REDUCE
    obj_memo_.emplace(t.unsafeGetTensorImpl(), next_memo_);
    memo_put();
    return absl::OkStatus();
  }

  // Appends `t`'s whole storage under `key`; one on a device as a CPU copy (synchronous), kept here.
  absl::Status add_storage(const at::Tensor& t, const c10::Storage& storage, size_t nbytes,
                           const std::string& key) {
    at::Tensor host;  // for a device storage: a byte tensor over all of it, copied to the CPU
    if (!t.device().is_cpu()) {
      try {
        host = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(t.device()));
        host = host.set_(storage, 0, std::vector<int64_t>{static_cast<int64_t>(nbytes)},
                         std::vector<int64_t>{1})
                   .cpu();
      } catch (const std::exception& e) {
        return error(
            absl::StrCat("copying its ", t.device().str(), " storage (", nbytes,
                         " bytes) to the CPU failed: ", std::string(e.what()).substr(0, 300)));
      }
    }
    const void* data = host.defined() ? host.data_ptr() : storage.data();
    if (data == nullptr && nbytes > 0) return error("the tensor's storage has no data");
    storages_.push_back({key, static_cast<const char*>(data), nbytes, std::move(host)});
    return absl::OkStatus();
  }
  struct StorageKey {
    std::string key;
    at::ScalarType dtype;
    std::string first_path;
  };
  std::string out_;
  uint32_t next_memo_ = 0;
  std::unordered_map<std::string, uint32_t> str_memo_, global_memo_;
  std::unordered_map<const void*, uint32_t> obj_memo_;  // lists, dicts, tuples, TensorImpls
  std::unordered_set<const void*> tuples_in_progress_;
  std::unordered_map<const c10::StorageImpl*, StorageKey> storage_keys_;
  std::vector<Storage> storages_;
  std::vector<PathPart> path_;
};

}  // namespace

absl::StatusOr<std::string> write_torch_file(const c10::IValue& value,
                                             const TorchFileWriteOptions& options) {
  const std::string& name = options.archive_name;
  const bool printable =
      std::all_of(name.begin(), name.end(), [](char c) { return c > ' ' && c < 0x7f; });
  if (name.empty() || name.size() > 1000 || !printable ||
      name.find_first_of("/\\") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("archive_name '", name,
                     "' must be 1 to 1000 printable ASCII "
                     "characters without '/' or '\\' (torch.save uses \"archive\")"));
  }
  Pickler pickler;
  if (absl::Status s = pickler.dump(value); !s.ok()) return s;
  static constexpr char kLittle[] = "little";
  static constexpr char kVersion[] = "3\n";
  size_t total = pickler.bytes().size() + 1024 + options.serialization_id.size() +
                 4 * ZipWriter::overhead(name.size() + 32);
  for (const auto& s : pickler.storages())
    total += s.nbytes + ZipWriter::overhead(name.size() + 6 + s.key.size());
  ZipWriter zip(name, options.force_zip64, total);
  zip.add("data.pkl", pickler.bytes().data(), pickler.bytes().size());
  zip.add("byteorder", kLittle, sizeof(kLittle) - 1);
  for (const auto& s : pickler.storages()) zip.add("data/" + s.key, s.data, s.nbytes);
  zip.add("version", kVersion, sizeof(kVersion) - 1);
  if (!options.serialization_id.empty()) {
    zip.add(".data/serialization_id", options.serialization_id.data(),
            options.serialization_id.size());
  }
  return zip.finish();
}

}  // namespace dtrain::checkpoint
