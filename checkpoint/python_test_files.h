// Test-only: PyTorch files written by Python at test time (checkpoint/testdata/make_python_files.py,
// run with $DTRAIN_PYTHON or /usr/bin/python3), and the digest that script prints, computed here
// for a c10::IValue so both sides can be compared line by line.
//
//   absl::StatusOr<std::string> dir = python_files_dir();   // once per test process
//   std::vector<std::string> want = read_lines(*dir + "/adam_one.txt");
//   EXPECT_EQ(digest(*load_state(*dir + "/adam_one.pt")), want);
//
// DTRAIN_PYTHON_FILES_DIR names a directory the script already wrote (e.g. with PyTorch 2.6 in
// another root) to use instead of running Python.
#ifndef DTRAIN_CHECKPOINT_PYTHON_TEST_FILES_H_
#define DTRAIN_CHECKPOINT_PYTHON_TEST_FILES_H_

#include <stdio.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "testing/pytorch_python.h"

namespace dtrain::checkpoint::testing {

inline std::string python_binary() { return dtrain::testing::pytorch_python(); }

inline constexpr char kScript[] = "checkpoint/testdata/make_python_files.py";

// Runs `command` through the shell; returns its exit status, stdout and stderr in `output`.
inline int run_command(const std::string& command, std::string* output) {
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) output->append(buf, n);
  const int status = ::pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

inline std::string test_tmpdir() {
  const char* t = std::getenv("TEST_TMPDIR");
  return t != nullptr ? t : "/tmp";
}

// The directory holding the script's files, written once per process.
inline absl::StatusOr<std::string> python_files_dir() {
  static const absl::StatusOr<std::string> dir = []() -> absl::StatusOr<std::string> {
    if (const char* given = std::getenv("DTRAIN_PYTHON_FILES_DIR");
        given != nullptr && *given != '\0') {
      return std::string(given);
    }
    const std::string out = test_tmpdir() + "/python_files";
    std::string output;
    if (run_command(absl::StrCat(python_binary(), " ", kScript, " write ", out), &output) != 0) {
      return absl::UnavailableError(
          absl::StrCat(python_binary(), " ", kScript,
                       " failed (is python3-torch "
                       "installed? ./bazelw installs it; DTRAIN_PYTHON picks another "
                       "python):\n",
                       output));
    }
    return out;
  }();
  return dir;
}

inline std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

inline std::string hex_of(const void* data, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i)
    absl::StrAppendFormat(&out, "%02x", static_cast<const unsigned char*>(data)[i]);
  return out;
}

inline std::string double_bits(double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, 8);
  return absl::StrFormat("%016x", bits);
}

inline std::string key_text(const c10::IValue& k) {
  if (k.isBool()) return k.toBool() ? "b:True" : "b:False";
  if (k.isInt()) return absl::StrCat("i:", k.toInt());
  if (k.isDouble()) return "f:" + double_bits(k.toDouble());
  if (k.isString()) return "s:" + k.toStringRef();
  return "?";
}

inline void walk(const std::string& path, const c10::IValue& v,
                 std::map<const void*, int>& storages, std::vector<std::string>& out) {
  static const std::map<at::ScalarType, std::string> kNames = {{at::kFloat, "float32"},
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
  if (v.isGenericDict()) {
    out.push_back(absl::StrCat(path, " dict ", v.toGenericDict().size()));
    for (const auto& kv : v.toGenericDict())
      walk(path + "/" + key_text(kv.key()), kv.value(), storages, out);
  } else if (v.isList() || v.isTuple()) {
    const std::vector<c10::IValue> items =
        v.isList() ? v.toList().vec() : v.toTupleRef().elements().vec();
    out.push_back(absl::StrCat(path, v.isList() ? " list " : " tuple ", items.size()));
    for (size_t i = 0; i < items.size(); ++i)
      walk(absl::StrCat(path, "/", i), items[i], storages, out);
  } else if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    std::string storage = "s-";
    if (t.numel() > 0) {
      const void* impl = t.storage().unsafeGetStorageImpl();
      storage = absl::StrCat(
          "s", storages.emplace(impl, static_cast<int>(storages.size())).first->second);
    }
    const at::Tensor c = t.detach().contiguous();
    out.push_back(absl::StrFormat(
        "%s tensor torch.%s [%s] [%s] %d %s %s %s", path, kNames.at(t.scalar_type()),
        absl::StrJoin(t.sizes(), ", "), absl::StrJoin(t.strides(), ", "), t.storage_offset(),
        t.requires_grad() ? "True" : "False", storage, hex_of(c.data_ptr(), c.nbytes())));
  } else if (v.isBool()) {
    out.push_back(absl::StrCat(path, " bool ", v.toBool() ? "True" : "False"));
  } else if (v.isInt()) {
    out.push_back(absl::StrCat(path, " int ", v.toInt()));
  } else if (v.isDouble()) {
    out.push_back(absl::StrCat(path, " float ", double_bits(v.toDouble())));
  } else if (v.isNone()) {
    out.push_back(path + " None");
  } else if (v.isString()) {
    out.push_back(
        absl::StrCat(path, " str ", hex_of(v.toStringRef().data(), v.toStringRef().size())));
  } else {
    out.push_back(absl::StrCat(path, " ? ", v.tagKind()));
  }
}

// The script's digest of `v` (see make_python_files.py).
inline std::vector<std::string> digest(const c10::IValue& v) {
  std::vector<std::string> out;
  std::map<const void*, int> storages;
  walk("", v, storages, out);
  return out;
}

}  // namespace dtrain::checkpoint::testing

#endif  // DTRAIN_CHECKPOINT_PYTHON_TEST_FILES_H_
