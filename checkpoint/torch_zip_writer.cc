#include "checkpoint/torch_zip_writer.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/zip_check.h"

namespace dtrain::checkpoint {
namespace {

// The storage class Python's pickler names for each dtype (torch/storage.py).
const char* storage_class(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "FloatStorage";
    case at::kDouble: return "DoubleStorage";
    case at::kHalf: return "HalfStorage";
    case at::kBFloat16: return "BFloat16Storage";
    case at::kLong: return "LongStorage";
    case at::kInt: return "IntStorage";
    case at::kShort: return "ShortStorage";
    case at::kChar: return "CharStorage";
    case at::kByte: return "ByteStorage";
    case at::kBool: return "BoolStorage";
    case at::kComplexFloat: return "ComplexFloatStorage";
    case at::kComplexDouble: return "ComplexDoubleStorage";
    default: return nullptr;
  }
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

class Pickler {
 public:
  struct Storage {
    std::string key;
    const char* data;
    size_t nbytes;
  };

  absl::Status dump(const c10::IValue& v) {
    out_ = "\x80\x02";  // PROTO 2, as torch.save writes
    if (absl::Status s = value(v, ""); !s.ok()) return s;
    out_.push_back('.');  // STOP
    return absl::OkStatus();
  }
  const std::string& bytes() const { return out_; }
  const std::vector<Storage>& storages() const { return storages_; }

 private:
  void str(const std::string& s) {
    out_.push_back('X');  // BINUNICODE
    put_le(out_, s.size(), 4);
    out_ += s;
  }
  void global(const char* module, const char* name) { out_ += absl::StrCat("c", module, "\n", name, "\n"); }
  void integer(int64_t v) {
    if (v >= 0 && v < 256) {
      out_.push_back('K');
      put_le(out_, static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v < 65536) {
      out_.push_back('M');
      put_le(out_, static_cast<uint64_t>(v), 2);
    } else if (v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max()) {
      out_.push_back('J');
      put_le(out_, static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
    } else {
      out_ += "\x8a\x08";  // LONG1, 8 bytes two's complement little-endian
      put_le(out_, static_cast<uint64_t>(v), 8);
    }
  }
  void ints_tuple(c10::IntArrayRef xs) {
    out_.push_back('(');
    for (int64_t x : xs) integer(x);
    out_.push_back('t');
  }

  absl::Status value(const c10::IValue& v, const std::string& path) {
    if (v.isNone()) {
      out_.push_back('N');
    } else if (v.isBool()) {
      out_.push_back(v.toBool() ? '\x88' : '\x89');
    } else if (v.isInt()) {
      integer(v.toInt());
    } else if (v.isDouble()) {
      const double d = v.toDouble();
      uint64_t bits;
      std::memcpy(&bits, &d, 8);
      out_.push_back('G');  // BINFLOAT, big-endian
      for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
    } else if (v.isString()) {
      str(v.toStringRef());
    } else if (v.isTensor()) {
      return tensor(v.toTensor(), path);
    } else if (v.isTuple()) {
      const auto& elements = v.toTupleRef().elements();
      out_.push_back('(');
      for (size_t i = 0; i < elements.size(); ++i) {
        if (absl::Status s = value(elements[i], absl::StrCat(path, "/", i)); !s.ok()) return s;
      }
      out_.push_back('t');
    } else if (v.isList()) {
      const c10::List<c10::IValue> list = v.toList();
      out_.push_back(']');
      if (list.size() > 0) {
        out_.push_back('(');
        for (size_t i = 0; i < list.size(); ++i) {
          if (absl::Status s = value(list.get(i), absl::StrCat(path, "/", i)); !s.ok()) return s;
        }
        out_.push_back('e');  // APPENDS
      }
    } else if (v.isGenericDict()) {
      const auto dict = v.toGenericDict();
      out_.push_back('}');
      if (dict.size() > 0) {
        out_.push_back('(');
        for (const auto& kv : dict) {
          const std::string key_name = kv.key().isString() ? kv.key().toStringRef()
                                       : kv.key().isInt()  ? std::to_string(kv.key().toInt())
                                                           : std::string("?");
          if (absl::Status s = value(kv.key(), path); !s.ok()) return s;
          if (absl::Status s = value(kv.value(), absl::StrCat(path, "/", key_name)); !s.ok()) return s;
        }
        out_.push_back('u');  // SETITEMS
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot write ", path.empty() ? "the value" : "'" + path.substr(1) + "'", ": a ", v.tagKind(),
          " is not a plain state-dict value (tensors, dicts, lists, tuples, strings, numbers, bools, None)"));
    }
    return absl::OkStatus();
  }

  absl::Status tensor(const at::Tensor& t, const std::string& path) {
    const std::string where = path.empty() ? "the value" : "'" + path.substr(1) + "'";
    if (!t.defined()) {
      out_.push_back('N');  // an undefined tensor is None in Python
      return absl::OkStatus();
    }
    const char* cls = storage_class(t.scalar_type());
    if (t.layout() != at::kStrided || t.is_quantized() || !t.device().is_cpu() || cls == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("cannot write ", where, ": only dense CPU tensors of the "
                                                     "standard dtypes are written, this one is ",
                                                     t.toString(), " on ", t.device().str()));
    }
    const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    auto it = keys_.find(impl);
    if (it == keys_.end()) {
      const std::string key = std::to_string(storages_.size());
      storages_.push_back({key, static_cast<const char*>(t.storage().data()), t.storage().nbytes()});
      it = keys_.emplace(impl, key).first;
    }
    const int64_t numel = static_cast<int64_t>(t.storage().nbytes() / t.element_size());
    global("torch._utils", "_rebuild_tensor_v2");
    out_.push_back('(');
    // Persistent id ('storage', torch.<Dtype>Storage, key, location, numel), then BINPERSID.
    out_.push_back('(');
    str("storage");
    global("torch", cls);
    str(it->second);
    str("cpu");
    integer(numel);
    out_ += "tQ";
    integer(t.storage_offset());
    ints_tuple(t.sizes());
    ints_tuple(t.strides());
    out_.push_back(t.requires_grad() ? '\x88' : '\x89');
    global("collections", "OrderedDict");  // backward_hooks: OrderedDict()
    out_ += ")R";
    out_ += "tR";  // the argument tuple, then REDUCE
    return absl::OkStatus();
  }

  std::string out_;
  std::vector<Storage> storages_;
  std::map<const c10::StorageImpl*, std::string> keys_;
};

class ZipWriter {
 public:
  // Adds a stored entry whose data starts at a multiple of 64 bytes (padding in the local header's
  // extra field, id "FB", as PyTorch's writer does).
  void add(const std::string& name, const char* data, size_t size) {
    const uint32_t crc = crc32_of(data, size);
    const size_t header_end = out_.size() + 30 + name.size() + 4;
    const size_t pad = (64 - header_end % 64) % 64;
    Entry e{name, crc, size, out_.size()};
    put_le(out_, 0x04034b50, 4);
    put_le(out_, 20, 2);  // version needed
    put_le(out_, 0, 2);   // flags
    put_le(out_, 0, 2);   // stored
    put_le(out_, 0, 2);   // time
    put_le(out_, 0x21, 2);  // date: 1980-01-01
    put_le(out_, crc, 4);
    put_le(out_, size, 4);
    put_le(out_, size, 4);
    put_le(out_, name.size(), 2);
    put_le(out_, 4 + pad, 2);
    out_ += name;
    out_ += "FB";
    put_le(out_, pad, 2);
    out_.append(pad, 'Z');
    if (size > 0) out_.append(data, size);
    entries_.push_back(e);
  }

  absl::StatusOr<std::string> finish() {
    const size_t cd_start = out_.size();
    for (const Entry& e : entries_) {
      put_le(out_, 0x02014b50, 4);
      put_le(out_, 20, 2);  // made by
      put_le(out_, 20, 2);  // needed
      put_le(out_, 0, 2);
      put_le(out_, 0, 2);
      put_le(out_, 0, 2);
      put_le(out_, 0x21, 2);
      put_le(out_, e.crc, 4);
      put_le(out_, e.size, 4);
      put_le(out_, e.size, 4);
      put_le(out_, e.name.size(), 2);
      put_le(out_, 0, 2);  // extra
      put_le(out_, 0, 2);  // comment
      put_le(out_, 0, 2);  // disk
      put_le(out_, 0, 2);  // internal attributes
      put_le(out_, 0, 4);  // external attributes
      put_le(out_, e.offset, 4);
      out_ += e.name;
    }
    const size_t cd_size = out_.size() - cd_start;
    if (out_.size() >= 0xffffffffu || entries_.size() >= 0xffff) {
      return absl::OutOfRangeError(absl::StrCat("the state is ", out_.size(), " bytes in ", entries_.size(),
                                                " entries; files of 4 GiB or 65535 entries need zip64, which "
                                                "dtrain does not write yet: save the state in shards "
                                                "(checkpoint/sharded.h)"));
    }
    put_le(out_, 0x06054b50, 4);
    put_le(out_, 0, 2);
    put_le(out_, 0, 2);
    put_le(out_, entries_.size(), 2);
    put_le(out_, entries_.size(), 2);
    put_le(out_, cd_size, 4);
    put_le(out_, cd_start, 4);
    put_le(out_, 0, 2);  // comment length: the caller may set it and append a comment
    return std::move(out_);
  }

 private:
  struct Entry {
    std::string name;
    uint32_t crc;
    size_t size;
    size_t offset;
  };
  std::string out_;
  std::vector<Entry> entries_;
};

}  // namespace

absl::StatusOr<std::string> write_torch_zip(const c10::IValue& value) {
  Pickler pickler;
  if (absl::Status s = pickler.dump(value); !s.ok()) return s;
  ZipWriter zip;
  zip.add("archive/data.pkl", pickler.bytes().data(), pickler.bytes().size());
  static constexpr char kLittle[] = "little";
  zip.add("archive/byteorder", kLittle, sizeof(kLittle) - 1);
  for (const auto& s : pickler.storages()) zip.add("archive/data/" + s.key, s.data, s.nbytes);
  static constexpr char kVersion[] = "3\n";
  zip.add("archive/version", kVersion, sizeof(kVersion) - 1);
  return zip.finish();
}

}  // namespace dtrain::checkpoint
