#include "comm/exception_status.h"

#include <stdexcept>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace dtrain::comm {
namespace {

absl::Status status_of(void (*thrower)(), absl::StatusCode code, std::string_view context = "") {
  try {
    thrower();
  } catch (...) {
    return current_exception_status(code, context);
  }
  return absl::OkStatus();
}

TEST(ExceptionStatusTest, KeepsTheCodeAndTheMessage) {
  absl::Status s = status_of([] { throw std::runtime_error("peer went away\nsecond line"); },
                             absl::StatusCode::kUnavailable, "allreduce");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "allreduce: peer went away\nsecond line");
  EXPECT_EQ(status_of([] { throw 42; }, absl::StatusCode::kInternal).message(),
            "unknown exception");
}

TEST(ExceptionStatusTest, C10ErrorsLoseTheirBacktrace) {
  absl::Status s =
      status_of([] { TORCH_CHECK(false, "bad shape"); }, absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "bad shape");
}

TEST(ExceptionStatusTest, TimeoutsAreDeadlineExceeded) {
  for (auto thrower :
       {+[] { throw std::runtime_error("[gloo] Timed out waiting 5000ms for recv"); },
        +[] { throw std::runtime_error("Socket Timeout"); },
        +[] { throw std::runtime_error("Wait timeout after 300000 ms"); }}) {
    EXPECT_EQ(status_of(thrower, absl::StatusCode::kUnavailable).code(),
              absl::StatusCode::kDeadlineExceeded);
  }
  EXPECT_FALSE(is_timeout_message("Connection reset by peer"));
}

}  // namespace
}  // namespace dtrain::comm
