// What write_torch_file refuses, and how it says so: values Python's torch.load cannot load back
// as written, and bad options. (The files it writes are checked in torch_file_writer_test.cc.)
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "checkpoint/torch_file_writer.h"
#include "testing/test_util.h"

namespace dtrain::checkpoint {
namespace {

using Dict = c10::impl::GenericDict;
using List = c10::impl::GenericList;

using test_util::any_list;
using test_util::str_dict;
using test_util::tuple;

TEST(TorchFileWriterTest, RefusesBadArchiveNames) {
  Dict d = str_dict();
  d.insert("w", at::ones({2}));
  TorchFileWriteOptions options;
  for (const char* bad : {"", "a/b", "a\\b", "with space"}) {
    options.archive_name = bad;
    absl::StatusOr<std::string> r = write_torch_file(d, options);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("archive_name"), std::string::npos) << r.status();
  }
}

// value at state/3/<name>; the error names that path and says what is wrong.
void expect_refused(const std::string& name, const c10::IValue& value, const std::string& what,
                    const std::string& where = "'state/3/") {
  Dict root = str_dict(), state(c10::IntType::get(), c10::AnyType::get()), entry = str_dict();
  entry.insert(name, value);
  state.insert(3, entry);
  root.insert("state", state);
  absl::StatusOr<std::string> r = write_torch_file(root);
  ASSERT_FALSE(r.ok()) << name;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find(where == "'state/3/" ? where + name + "'" : where),
            std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status();
}

TEST(TorchFileWriterTest, RefusesWhatPythonCannotLoad) {
  expect_refused("sparse", at::ones({2, 2}).to_sparse(), "Sparse");
  expect_refused("quantized", at::quantize_per_tensor(at::ones({2}), 0.1, 0, at::kQUInt8), "dense");
  expect_refused("meta", at::empty({2}, at::TensorOptions().device(at::kMeta)),
                 "a meta tensor has no data");
  expect_refused("conj", at::ones({2}, at::kComplexFloat).conj(), "resolve_conj");
  expect_refused("complex", c10::complex<double>(1, 2), "ComplexDouble");
  expect_refused("future", c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get()), "Future");
  expect_refused("device", c10::Device(c10::kCPU), "Device");
  expect_refused("bytes", std::string("ok\xff"), "UTF-8");
  expect_refused("surrogate", std::string("\xed\xa0\x80"), "UTF-8");
  const at::Tensor f = at::ones({4});
  expect_refused("two_dtypes", tuple({f, f.view(at::kInt)}),
                 "views the storage of 'state/3/two_dtypes/0'", "'state/3/two_dtypes/1'");
  Dict collide(c10::AnyType::get(), c10::AnyType::get());
  collide.insert(int64_t{1}, std::string("int"));
  collide.insert(1.0, std::string("float"));
  expect_refused("keys", collide, "its keys 1 and 1.0 are one key");
  c10::IValue deep = any_list();
  for (int i = 0; i < 250; ++i) {
    List outer = any_list();
    outer.push_back(deep);
    deep = outer;
  }
  expect_refused("deep", deep, "nested deeper than 200", "'state/3/deep/0/0/0");
  List loop = any_list();
  const c10::IValue looped = tuple({loop});
  loop.push_back(looped);
  expect_refused("loop", looped, "the tuple contains itself", "'state/3/loop/0/0'");
  loop.clear();  // break the reference cycle
}

}  // namespace
}  // namespace dtrain::checkpoint
