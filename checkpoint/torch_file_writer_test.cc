#include "checkpoint/torch_file_writer.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "testing/pytorch_python.h"
#include "testing/test_util.h"

namespace dtrain::checkpoint {
namespace {

using Dict = c10::impl::GenericDict;
using List = c10::impl::GenericList;

using test_util::any_list;
using test_util::str_dict;
using test_util::tuple;

// ---- The canonical dump, the same text check_written_file.py prints for what Python loaded ----

const char* dtype_name(at::ScalarType t) {  // Python's name
  static const std::map<at::ScalarType, const char*> kNames = {{at::kFloat, "float32"},
                                                               {at::kDouble, "float64"},
                                                               {at::kHalf, "float16"},
                                                               {at::kBFloat16, "bfloat16"},
                                                               {at::kLong, "int64"},
                                                               {at::kInt, "int32"},
                                                               {at::kShort, "int16"},
                                                               {at::kChar, "int8"},
                                                               {at::kByte, "uint8"},
                                                               {at::kBool, "bool"},
                                                               {at::kComplexFloat, "complex64"},
                                                               {at::kComplexDouble, "complex128"}};
  return kNames.at(t);
}

std::string hex(const void* data, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i)
    absl::StrAppendFormat(&s, "%02x", static_cast<const unsigned char*>(data)[i]);
  return s;
}

std::string join(c10::IntArrayRef xs) {
  std::string s;
  for (size_t i = 0; i < xs.size(); ++i) absl::StrAppend(&s, i ? "," : "", xs[i]);
  return s;
}

class Dumper {
 public:
  // identity: print storage= and obj= (shared storages and objects); LibTorch's reader keeps neither.
  explicit Dumper(bool identity) : identity_(identity) {}
  std::vector<std::string> lines;

  void walk(const std::string& path, const c10::IValue& v) {
    auto out = [&](const std::string& text) { lines.push_back(path + " " + text); };
    if (v.isNone() || (v.isTensor() && !v.toTensor().defined())) {
      out("none");
    } else if (v.isBool()) {
      out(absl::StrCat("bool ", v.toBool() ? 1 : 0));
    } else if (v.isInt()) {
      out(absl::StrCat("int ", v.toInt()));
    } else if (v.isDouble()) {
      const double d = v.toDouble();
      uint64_t bits;
      std::memcpy(&bits, &d, 8);
      out(absl::StrFormat("float %016x", bits));
    } else if (v.isString()) {
      out("str " + hex(v.toStringRef().data(), v.toStringRef().size()));
    } else if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      const size_t nbytes = t.storage().nbytes();
      std::string ids;
      if (identity_) {
        const void* s = t.storage().unsafeGetStorageImpl();
        const std::string sid =
            nbytes == 0 ? "empty"
                        : std::to_string(storages_.emplace(s, storages_.size()).first->second);
        ids = absl::StrCat(" storage=", sid, " obj=", obj(t.unsafeGetTensorImpl()));
      }
      const at::Tensor c = t.contiguous();
      out(absl::StrCat("tensor dtype=", dtype_name(t.scalar_type()), " shape=", join(t.sizes()),
                       " stride=", join(t.strides()), " offset=", t.storage_offset(),
                       " grad=", t.requires_grad() ? 1 : 0, " snbytes=", nbytes, ids,
                       " data=", hex(c.data_ptr(), c.numel() * c.element_size())));
    } else if (v.isTuple()) {
      const auto& xs = v.toTupleRef().elements();
      out(absl::StrCat(
          "tuple n=", xs.size(),
          identity_ && !xs.empty() ? absl::StrCat(" obj=", obj(v.internalToPointer())) : ""));
      for (size_t i = 0; i < xs.size(); ++i) walk(absl::StrCat(path, "/", i), xs[i]);
    } else if (v.isList()) {
      const c10::List<c10::IValue> xs = v.toList();
      out(absl::StrCat("list n=", xs.size(),
                       identity_ ? absl::StrCat(" obj=", obj(v.internalToPointer())) : ""));
      for (size_t i = 0; i < xs.size(); ++i) walk(absl::StrCat(path, "/", i), xs.get(i));
    } else if (v.isGenericDict()) {
      const auto d = v.toGenericDict();
      out(absl::StrCat("dict n=", d.size(),
                       identity_ ? absl::StrCat(" obj=", obj(v.internalToPointer())) : ""));
      size_t i = 0;
      for (const auto& kv : d) {
        walk(absl::StrCat(path, "/#", i, ".key"), kv.key());
        walk(absl::StrCat(path, "/#", i++), kv.value());
      }
    } else {
      out(std::string("unexpected ") + v.tagKind());
    }
  }

 private:
  size_t obj(const void* p) { return objs_.emplace(p, objs_.size()).first->second; }
  bool identity_;
  std::unordered_map<const void*, size_t> objs_, storages_;
};

std::vector<std::string> dump(const c10::IValue& v, bool identity) {
  Dumper d(identity);
  d.walk("", v);
  return d.lines;
}

bool any_line_has(const std::vector<std::string>& lines, const std::string& what) {
  for (const auto& l : lines) {
    if (l.find(what) != std::string::npos) return true;
  }
  return false;
}

bool respelled(const std::vector<std::string>& lines) {
  for (const auto& l : lines) {
    const size_t at = l.find(" int ");
    if (at != std::string::npos) {
      const int64_t v = std::stoll(l.substr(at + 5));
      if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
        return true;
    }
  }
  return any_line_has(lines, " dict n=1 ") || any_line_has(lines, " list n=1 ");
}

// ---- Running Python ----

std::string python() { return dtrain::testing::pytorch_python(); }

std::string tmp_dir() {
  const char* t = std::getenv("TEST_TMPDIR");
  return t != nullptr ? t : "/tmp";
}

struct Written {
  std::string name;
  c10::IValue value;
  std::string bytes;
};

Written write(const std::string& name, const c10::IValue& value,
              const TorchFileWriteOptions& options = {}) {
  absl::StatusOr<std::string> bytes = write_torch_file(value, options);
  EXPECT_TRUE(bytes.ok()) << name << ": " << bytes.status();
  return {name, value, bytes.ok() ? *bytes : std::string()};
}

std::string save(const Written& w) {
  const std::string path = tmp_dir() + "/" + w.name + ".pt";
  std::ofstream(path, std::ios::binary) << w.bytes;
  // DTRAIN_WRITER_DUMP_DIR=/some/dir keeps copies, to check them by hand with another PyTorch.
  if (const char* keep = std::getenv("DTRAIN_WRITER_DUMP_DIR"); keep != nullptr && *keep != '\0') {
    std::ofstream(std::string(keep) + "/" + w.name + ".pt", std::ios::binary) << w.bytes;
  }
  return path;
}

std::string run(const std::string& command) {
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  EXPECT_NE(p, nullptr) << command;
  if (p == nullptr) return "";
  std::string output;
  char buf[65536];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) output.append(buf, n);
  EXPECT_EQ(::pclose(p), 0) << command << "\n" << output.substr(0, 4000);
  return output;
}

// Python's torch.load (every mode its version has) reads each file as the value written; also
// LibTorch's pickle_load.
void expect_readable(const std::vector<Written>& files) {
  std::string command = python() + " checkpoint/testdata/check_written_file.py";
  std::vector<std::string> paths;
  for (const Written& w : files) {
    paths.push_back(save(w));
    command += " " + paths.back();
  }
  const std::string output = run(command);
  std::istringstream in(output);
  std::string line;
  std::getline(in, line);
  ASSERT_EQ(line.rfind("torch ", 0), 0u) << output.substr(0, 4000);
  const bool v1 = line.rfind("torch 1.", 0) == 0;
  std::map<std::string, std::vector<std::string>> sections;
  std::vector<std::string>* current = nullptr;
  while (std::getline(in, line)) {
    if (line.rfind("== ", 0) == 0) {
      current = &sections[line.substr(3)];
    } else if (current != nullptr) {
      current->push_back(line);
    }
  }
  for (size_t f = 0; f < files.size(); ++f) {
    const Written& w = files[f];
    SCOPED_TRACE(w.name);
    const std::vector<std::string>& got = sections[paths[f]];
    const std::vector<std::string> want_dump = dump(w.value, true);
    std::vector<std::string> want = {"ALIGN ok", "CRC ok", "LOAD default ok"};
    want.push_back(v1 && any_line_has(want_dump, " float ") ? "LOAD weights_only 1.13-binfloat"
                                                            : "LOAD weights_only ok");
    if (!v1) want.push_back("LOAD mmap ok");
    // torch.save spells one-item dicts and lists and ints beyond 32 bits otherwise (same ops).
    want.push_back(respelled(want_dump) ? "RESAVE same-ops" : "RESAVE same");
    std::vector<std::string> got_header;
    size_t i = 0;
    for (; i < got.size() && got[i] != "DUMP"; ++i) {
      if (got[i].rfind("ENTRIES ", 0) != 0) got_header.push_back(got[i]);
    }
    EXPECT_EQ(got_header, want) << output.substr(0, 4000);
    const std::vector<std::string> got_dump(got.begin() + std::min(i + 1, got.size()), got.end());
    EXPECT_EQ(got_dump, want_dump);

    // LibTorch reads it back too (containers come back Any-typed; storages are not shared).
    c10::IValue back;
    try {
      back = torch::jit::pickle_load(std::vector<char>(w.bytes.begin(), w.bytes.end()));
    } catch (const c10::Error& e) {
      ADD_FAILURE() << "pickle_load: " << e.what_without_backtrace();
      continue;
    }
    EXPECT_EQ(dump(back, false), dump(w.value, false));
  }
}

// ---- Values ----

const std::vector<at::ScalarType> kDtypes = {
    at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong,         at::kInt,
    at::kShort, at::kChar,   at::kByte, at::kBool,     at::kComplexFloat, at::kComplexDouble};

at::Tensor interesting(at::ScalarType t) {  // extremes, signed zeros, inf, NaN, subnormals
  const double inf = std::numeric_limits<double>::infinity(),
               nan = std::numeric_limits<double>::quiet_NaN();
  if (at::isFloatingType(t) || at::isComplexType(t)) {
    const at::Tensor x =
        at::tensor({0.0, -0.0, 1.5, -2.25, 1e-40, 3e38, inf, -inf, nan, 1.0 / 3}, at::kDouble);
    return (at::isComplexType(t) ? at::complex(x, x.flip(0)) : x).to(t).reshape({2, 5});
  }
  if (t == at::kBool) return at::tensor({1, 0, 0, 1, 1}, at::kLong).to(t);
  const int bits = static_cast<int>(c10::elementSize(t)) * 8;
  const int64_t lo = t == at::kByte ? 0
                     : bits == 64   ? std::numeric_limits<int64_t>::min()
                                    : -(int64_t{1} << (bits - 1));
  const int64_t hi = t == at::kByte ? 255
                     : bits == 64   ? std::numeric_limits<int64_t>::max()
                                    : -lo - 1;
  return at::tensor({lo, hi, int64_t{0}, int64_t{1}, int64_t{100}}, at::kLong)
      .to(t)
      .reshape({5, 1});
}

TEST(TorchFileWriterTest, EveryDtypeInNestedDicts) {
  Dict d = str_dict(), inner = str_dict();
  for (at::ScalarType t : kDtypes) {
    inner.insert(dtype_name(t), interesting(t));
    Dict deeper = str_dict();
    deeper.insert("scalar", interesting(t).reshape(-1)[1].clone());
    deeper.insert("transposed", interesting(t).t());
    inner.insert(std::string(dtype_name(t)) + "_more", deeper);
  }
  d.insert("dtypes", inner);
  expect_readable({write("dtypes", d)});
}

TEST(TorchFileWriterTest, ViewsShareOneStorage) {
  const at::Tensor base = at::arange(24, at::kFloat), longs = at::arange(10, at::kLong);
  Dict d = str_dict();
  d.insert("base", base);
  d.insert("row", base.narrow(0, 4, 4));                      // offset 4
  d.insert("transposed", base.view({4, 6}).t());              // strides 1, 6
  d.insert("column", base.view({4, 6}).select(1, 2));         // offset 2, stride 6
  d.insert("expanded", base.narrow(0, 5, 1).expand({3, 4}));  // stride 0
  d.insert("element", base[7]);                               // 0-dim view
  d.insert("copy", base.clone());                             // equal values, its own storage
  d.insert("base_again", base);  // the same tensor: one object in Python
  d.insert("longs", tuple({longs.narrow(0, 8, 2), longs.view({2, 5})}));
  expect_readable({write("views", d)});
}

TEST(TorchFileWriterTest, EdgeCaseTensors) {
  Dict d = str_dict();
  d.insert("empty", at::empty({0, 3}));
  d.insert("empty_bool", at::empty({0}, at::kBool));
  d.insert("empty_view_at_end", at::arange(5).narrow(0, 5, 0));
  d.insert("scalar", at::scalar_tensor(2.5));
  d.insert("int_scalar", at::scalar_tensor(-7, at::kLong));
  d.insert("grad", at::ones({2, 2}).requires_grad_());
  d.insert("undefined", at::Tensor());  // None in Python
  d.insert("slice_of_big",
           at::arange(1000, at::kLong).narrow(0, 990, 3));  // the whole storage goes
  d.insert("five_dims", at::arange(6, at::kShort).reshape({1, 2, 1, 3, 1}));
  expect_readable({write("edge_tensors", d)});
}

TEST(TorchFileWriterTest, ScalarsStringsAndContainers) {
  const int64_t i64min = std::numeric_limits<int64_t>::min(),
                i64max = std::numeric_limits<int64_t>::max();
  const int64_t p31 = int64_t{1} << 31, p39 = int64_t{1} << 39, p47 = int64_t{1} << 47;
  std::vector<int64_t> ints = {0,           1,
                               255,         256,
                               65535,       65536,
                               -1,          -255,
                               -256,        -257,
                               -p31,        p31 - 1,
                               -p31 - 1,    p31,
                               p31 * 2,     p39 - 1,
                               p39,         -p39,
                               -p39 - 1,    p39 * 2,
                               p47,         -p47,
                               -p47 - 1,    p47 << 8,
                               -(p47 << 8), (int64_t{1} << 53) + 1,
                               i64min,      i64max,
                               i64min + 1};
  const double inf = std::numeric_limits<double>::infinity(), payload_nan = std::nan("0x123");
  Dict d = str_dict();
  d.insert("ints", c10::List<int64_t>(ints));
  d.insert("floats", c10::List<double>({0.0, -0.0, 0.1, -2.5, 1e308, 5e-324, inf, -inf,
                                        std::numeric_limits<double>::quiet_NaN(), payload_nan,
                                        -payload_nan}));
  d.insert("bools", c10::List<bool>({true, false, true}));
  for (auto [key, v] :
       {std::pair<const char*, c10::IValue>{"true", true}, {"false", false}, {"none", {}}}) {
    d.insert(key, v);
  }
  d.insert("strings",
           c10::List<std::string>({"", "a", "plain", "grüße, 世界", "emoji 🙂",
                                   "quote ' \" back \\ newline \n tab \t",
                                   std::string("nul\0inside", 10), std::string(300, 'x')}));
  d.insert("tensors", c10::List<at::Tensor>({at::ones({2}), at::zeros({1}, at::kInt)}));
  List nested = any_list(), inner = any_list();
  inner.push_back(tuple({}));
  inner.push_back(tuple({int64_t{1}}));
  inner.push_back(tuple({int64_t{1}, std::string("two")}));
  inner.push_back(tuple({int64_t{1}, 2.0, c10::IValue()}));
  inner.push_back(tuple({int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}}));
  inner.push_back(tuple(
      {tuple({tuple({})}), any_list(), str_dict(), c10::List<int64_t>({7}), std::string("x")}));
  nested.push_back(inner);
  nested.push_back(any_list());
  d.insert("nested", nested);
  Dict keys(c10::AnyType::get(), c10::AnyType::get());  // Any-typed keys of several kinds
  keys.insert(std::string("k"), int64_t{1});
  keys.insert(int64_t{3}, std::string("three"));
  keys.insert(2.5, std::string("two and a half"));
  keys.insert(false, std::string("no"));
  d.insert("mixed_keys", keys);
  expect_readable({write("scalars", d)});
}

// An optimizer state dict as torch.optim.Adam's state_dict() has it: Python's Adam loads it.
Dict adam_state_dict() {
  Dict sd = str_dict(), state(c10::IntType::get(), c10::AnyType::get());
  for (int64_t i = 0; i < 3; ++i) {
    Dict e = str_dict();
    e.insert("step", at::scalar_tensor(3.0));
    e.insert("exp_avg", at::arange(6 * (i + 1), at::kFloat).mul(0.37).reshape({i + 1, 6}));
    e.insert("exp_avg_sq",
             at::arange(6 * (i + 1), at::kFloat).pow(2).mul(0.01).reshape({i + 1, 6}));
    state.insert(i, e);
  }
  sd.insert("state", state);
  Dict g = str_dict();
  g.insert("lr", 1e-3);
  g.insert("betas", tuple({0.9, 0.999}));
  g.insert("eps", 1e-8);
  g.insert("weight_decay", 0.0);
  for (const char* flag : {"amsgrad", "maximize", "capturable", "differentiable"})
    g.insert(flag, false);
  g.insert("foreach", c10::IValue());
  g.insert("fused", c10::IValue());
  g.insert("params", c10::List<int64_t>({0, 1, 2}));
  List groups = any_list();
  groups.push_back(g);
  sd.insert("param_groups", groups);
  return sd;
}

TEST(TorchFileWriterTest, AdamStateDictLoadsIntoPythonsAdam) {
  Written w = write("adam", adam_state_dict());
  expect_readable({w});
  EXPECT_EQ(run(python() + " checkpoint/testdata/check_written_adam.py " + save(w)), "adam ok\n");
}

TEST(TorchFileWriterTest, BatchesAndSharedObjectsLikeCPythonsPickler) {
  Dict d = str_dict();
  for (int64_t n : {2, 999, 1000, 1001, 2000, 2001}) {
    Dict big(c10::IntType::get(), c10::AnyType::get());
    List list = any_list();
    for (int64_t i = 0; i < n; ++i) {
      big.insert(i * 7, i);
      list.push_back(absl::StrCat("s", i % 300));  // repeated strings: one memo entry each
    }
    d.insert(absl::StrCat("dict", n), big);
    d.insert(absl::StrCat("list", n), list);
  }
  List one = any_list();
  one.push_back(int64_t{1});
  d.insert("one_item_list", one);
  const at::Tensor t = at::ones({3});
  List shared = any_list();
  shared.push_back(t);
  const c10::IValue shared_tuple = tuple({t, shared});
  Dict shared_dict = str_dict();
  shared_dict.insert("t", t);
  for (const char* name : {"a", "b"}) {
    d.insert(absl::StrCat("shared_list_", name), shared);
    d.insert(absl::StrCat("shared_tuple_", name), shared_tuple);
    d.insert(absl::StrCat("shared_dict_", name), shared_dict);
  }
  expect_readable({write("batches", d)});
}

TEST(TorchFileWriterTest, EndRecordIsLastAndACommentCanBeAppended) {
  Written w = write("commented", adam_state_dict());
  ASSERT_GE(w.bytes.size(), 22u);
  const std::string eocd = w.bytes.substr(w.bytes.size() - 22);
  EXPECT_EQ(eocd.substr(0, 4), std::string("PK\x05\x06", 4));
  EXPECT_EQ(eocd.substr(20), std::string("\0\0", 2));  // comment length 0
  // No zip64 records in a small file: the end record's counts and offsets are exact.
  EXPECT_NE(w.bytes.substr(w.bytes.size() - 42, 4), std::string("PK\x06\x07", 4));
  const std::string comment = "dtrain-state-file crc=0badf00d";
  w.bytes[w.bytes.size() - 2] = static_cast<char>(comment.size());
  w.bytes += comment;
  expect_readable({w});
}

TEST(TorchFileWriterTest, Zip64RecordsWhenForced) {
  TorchFileWriteOptions options;
  options.force_zip64 = true;
  Written w = write("zip64_forced", adam_state_dict(), options);
  EXPECT_EQ(w.bytes.substr(w.bytes.size() - 42, 4), std::string("PK\x06\x07", 4));  // zip64 locator
  EXPECT_EQ(w.bytes.substr(w.bytes.size() - 14, 6), std::string("\xff\xff\xff\xff\xff\xff", 6));
  expect_readable({w});
}

TEST(TorchFileWriterTest, Zip64ForMoreThan65534Entries) {
  List many = any_list();  // 65540 storages + 4 other entries
  for (int64_t i = 0; i < 65540; ++i) many.push_back(at::full({1}, i, at::kInt));
  Written w = write("zip64_entries", many);
  EXPECT_EQ(w.bytes.substr(w.bytes.size() - 42, 4), std::string("PK\x06\x07", 4));
  EXPECT_EQ(w.bytes.substr(w.bytes.size() - 14, 4),
            std::string("\xff\xff\xff\xff", 4));  // 0xFFFF entries
  expect_readable({w});
}

TEST(TorchFileWriterTest, ArchiveNameAndSerializationId) {
  TorchFileWriteOptions options;
  options.archive_name = "my_state";
  options.serialization_id = "0566351950441819419703760964850523215451";
  Dict d = str_dict();
  d.insert("w", at::ones({2}));
  Written w = write("named", d, options);
  expect_readable({w});
  const std::string listing =
      run(python() +
          " -c \"import sys, zipfile; print(' '.join(zipfile.ZipFile(sys.argv[1])"
          ".namelist()))\" " +
          save(w));
  EXPECT_EQ(listing,
            "my_state/data.pkl my_state/byteorder my_state/data/0 my_state/version "
            "my_state/.data/serialization_id\n");
}

}  // namespace
}  // namespace dtrain::checkpoint
