#include "checkpoint/torch_zip_writer.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace dtrain::checkpoint {
namespace {

using Dict = c10::impl::GenericDict;

// What Python's torch.load (weights_only=True on 2.x, its default there) must find in the file: every check is an
// assert in this script, which prints "ok" at the end.
constexpr char kCheck[] = R"(
import math, sys, torch
# PyTorch 1.13's weights-only unpickler lacks BINFLOAT (it cannot read its own Adam state dict
# that way); 2.x's reads everything torch.save writes, and is its default.
weights_only = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 0)
d = torch.load(sys.argv[1], weights_only=weights_only)
base = d["base"]
assert base.dtype == torch.float32 and base.tolist() == [float(i) for i in range(12)], base
row = d["views"][0]; col = d["views"][1]
assert row.tolist() == [4.0, 5.0, 6.0, 7.0], row
assert col.shape == (3,) and col.stride() == (4,) and col.tolist() == [1.0, 5.0, 9.0], col
ptr = lambda t: t.untyped_storage().data_ptr() if hasattr(t, "untyped_storage") else t.storage().data_ptr()
assert ptr(row) == ptr(base) and ptr(col) == ptr(base), "views must share the base's storage"
row.add_(100); assert base[4].item() == 104.0
for name, dtype in (("half", torch.float16), ("bf16", torch.bfloat16), ("i8", torch.int8), ("u8", torch.uint8),
                    ("i16", torch.int16), ("i32", torch.int32), ("i64", torch.int64), ("f64", torch.float64),
                    ("c64", torch.complex64), ("b", torch.bool)):
    t = d["dtypes"][name]
    assert t.dtype == dtype, (name, t.dtype)
    assert t.tolist() == torch.arange(3).to(dtype).tolist(), (name, t)
assert d["ints"] == [0, 255, 256, 65535, 65536, -1, -2**31, 2**31 - 1, -2**31 - 1, 2**40, -2**63, 2**63 - 1], d["ints"]
f = d["floats"]; assert f[0] == 0.1 and f[1] == -2.5 and math.isinf(f[2]) and math.isnan(f[3]), f
assert d["tuple"] == (1, "two", 3.0, None, True, False), d["tuple"]
assert d["empty_list"] == [] and d["empty_dict"] == {} and d["nested"] == [[1, [2]], {"k": [3]}], d["nested"]
assert d["text"] == "grüße, 世界", d["text"]
assert d["int_keys"] == {0: "a", 7: "b"}, d["int_keys"]
assert d["grad"].requires_grad and d["grad"].tolist() == [1.0, 1.0]
assert d["empty"].shape == (0, 3) and d["scalar"].dim() == 0 and d["scalar"].item() == 2.5
assert d["none"] is None
print("ok")
)";

std::string python() {
  const char* p = std::getenv("DTRAIN_PYTHON");
  return p != nullptr && *p != '\0' ? p : "/usr/bin/python3";
}

TEST(TorchZipWriterTest, PythonLoadsItWithWeightsOnly) {
  Dict d(c10::StringType::get(), c10::AnyType::get());
  at::Tensor base = at::arange(12, at::kFloat);
  d.insert("base", base);
  d.insert("views", c10::ivalue::Tuple::create({base.narrow(0, 4, 4), base.view({3, 4}).select(1, 1)}));
  Dict dtypes(c10::StringType::get(), c10::AnyType::get());
  for (auto [name, t] : std::vector<std::pair<const char*, at::ScalarType>>{
           {"half", at::kHalf}, {"bf16", at::kBFloat16}, {"i8", at::kChar}, {"u8", at::kByte}, {"i16", at::kShort},
           {"i32", at::kInt}, {"i64", at::kLong}, {"f64", at::kDouble}, {"c64", at::kComplexFloat}, {"b", at::kBool}}) {
    dtypes.insert(name, at::arange(3).to(t));
  }
  d.insert("dtypes", dtypes);
  d.insert("ints", c10::List<int64_t>({0, 255, 256, 65535, 65536, -1, -(int64_t{1} << 31), (int64_t{1} << 31) - 1,
                                       -(int64_t{1} << 31) - 1, int64_t{1} << 40,
                                       std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()}));
  d.insert("floats", c10::List<double>({0.1, -2.5, std::numeric_limits<double>::infinity(),
                                        std::numeric_limits<double>::quiet_NaN()}));
  d.insert("tuple", c10::ivalue::Tuple::create({int64_t{1}, std::string("two"), 3.0, c10::IValue(), true, false}));
  d.insert("empty_list", c10::impl::GenericList(c10::AnyType::get()));
  d.insert("empty_dict", Dict(c10::StringType::get(), c10::AnyType::get()));
  c10::impl::GenericList inner(c10::AnyType::get());
  inner.push_back(int64_t{1});
  inner.push_back(c10::List<int64_t>({2}));
  Dict k(c10::StringType::get(), c10::AnyType::get());
  k.insert("k", c10::List<int64_t>({3}));
  c10::impl::GenericList nested(c10::AnyType::get());
  nested.push_back(inner);
  nested.push_back(k);
  d.insert("nested", nested);
  d.insert("text", std::string("grüße, 世界"));
  Dict ik(c10::IntType::get(), c10::AnyType::get());
  ik.insert(int64_t{0}, std::string("a"));
  ik.insert(int64_t{7}, std::string("b"));
  d.insert("int_keys", ik);
  d.insert("grad", at::ones({2}).requires_grad_());
  d.insert("empty", at::empty({0, 3}));
  d.insert("scalar", at::scalar_tensor(2.5));
  d.insert("none", c10::IValue());

  absl::StatusOr<std::string> bytes = write_torch_zip(d);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = tmp != nullptr ? tmp : "/tmp";
  const std::string path = dir + "/written.pt", script = dir + "/check.py";
  std::ofstream(path, std::ios::binary) << *bytes;
  std::ofstream(script) << kCheck;
  FILE* p = ::popen((python() + " " + script + " " + path + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string output;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) output.append(buf, n);
  const int rc = ::pclose(p);
  EXPECT_EQ(rc, 0) << output;
  EXPECT_EQ(output, "ok\n");
}

TEST(TorchZipWriterTest, RefusesWhatPythonsWeightsOnlyLoaderWouldNot) {
  Dict d(c10::StringType::get(), c10::AnyType::get());
  Dict inner(c10::StringType::get(), c10::AnyType::get());
  inner.insert("sparse", at::ones({2, 2}).to_sparse());
  d.insert("state", inner);
  absl::StatusOr<std::string> bytes = write_torch_zip(d);
  ASSERT_FALSE(bytes.ok());
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bytes.status().message().find("'state/sparse'"), std::string::npos) << bytes.status();
}

}  // namespace
}  // namespace dtrain::checkpoint
