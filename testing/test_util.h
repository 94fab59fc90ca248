// Helpers every package's tests share (tensorstore's status_testutil plays this part there): one
// definition each, tested in test_util_test.cc.
//
//   dtrain::test_util::expect_error([&] { FunctionalSGD(p, SGDOptions(-0.1)); },
//                                   "Invalid learning rate: -0.1");
//   c10::impl::GenericDict d = dtrain::test_util::str_dict();   // {} : Dict[str, Any]
//   d.insert("lr", 0.1);
#ifndef DTRAIN_TESTING_TEST_UTIL_H_
#define DTRAIN_TESTING_TEST_UTIL_H_

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace dtrain::test_util {

// Expects f() to throw a c10::Error (TORCH_CHECK's) whose message, without the backtrace,
// contains `message`; a non-fatal failure naming `message` when it returns or the text differs.
inline void expect_error(const std::function<void()>& f, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing: " << message;
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr(message));
  }
}

// An empty Dict[str, Any], the type of PyTorch's state dicts and param groups.
inline c10::impl::GenericDict str_dict() {
  return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
}

// An empty List[Any], for nested containers in state dicts.
inline c10::impl::GenericList any_list() { return c10::impl::GenericList(c10::AnyType::get()); }

// A tuple of `items`.
inline c10::IValue tuple(std::vector<c10::IValue> items) {
  return c10::ivalue::Tuple::create(std::move(items));
}

}  // namespace dtrain::test_util

#endif  // DTRAIN_TESTING_TEST_UTIL_H_
