#include "testing/test_util.h"

#include <gtest/gtest-spi.h>

namespace dtrain::test_util {
namespace {

TEST(TestUtilTest, ExpectErrorPassesOnTheMessage) {
  expect_error([] { TORCH_CHECK(false, "Invalid learning rate: ", -0.1); }, "learning rate: -0.1");
}

TEST(TestUtilTest, ExpectErrorFailsWhenNothingIsThrownOrTheTextDiffers) {
  EXPECT_NONFATAL_FAILURE(expect_error([] {}, "some error"),
                          "expected an error containing: some error");
  EXPECT_NONFATAL_FAILURE(expect_error([] { TORCH_CHECK(false, "another"); }, "some error"),
                          "some error");
}

TEST(TestUtilTest, StrDictIsAnEmptyStringKeyedDict) {
  c10::impl::GenericDict d = str_dict();
  EXPECT_EQ(d.size(), 0u);
  EXPECT_EQ(d.keyType()->kind(), c10::TypeKind::StringType);
  EXPECT_EQ(d.valueType()->kind(), c10::TypeKind::AnyType);
}

TEST(TestUtilTest, AnyListAndTuple) {
  c10::impl::GenericList l = any_list();
  EXPECT_EQ(l.size(), 0u);
  EXPECT_EQ(l.elementType()->kind(), c10::TypeKind::AnyType);
  const c10::IValue t = tuple({int64_t{1}, std::string("two")});
  ASSERT_TRUE(t.isTuple());
  ASSERT_EQ(t.toTupleRef().elements().size(), 2u);
  EXPECT_EQ(t.toTupleRef().elements()[0].toInt(), 1);
  EXPECT_EQ(t.toTupleRef().elements()[1].toStringRef(), "two");
}

}  // namespace
}  // namespace dtrain::test_util
