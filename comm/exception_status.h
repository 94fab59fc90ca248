// The one place dtrain turns an exception into an absl::Status: LibTorch, Gloo and TensorPipe
// report failures by throwing, and dtrain's APIs return a Status where failure is an expected
// outcome. The message is c10::Error's without its C++ backtrace, any other std::exception's
// what(), or "unknown exception"; a timeout (LibTorch's and Gloo's "timed out" / "Timeout"
// wording) becomes DeadlineExceeded, whatever code the caller gives for other failures.
//
//   try {
//     work->wait();
//   } catch (...) {
//     return dtrain::comm::current_exception_status(absl::StatusCode::kUnavailable, "broadcast_object");
//   }
#ifndef DTRAIN_COMM_EXCEPTION_STATUS_H_
#define DTRAIN_COMM_EXCEPTION_STATUS_H_

#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace dtrain::comm {

// The message of the exception being handled (all lines). REQUIRES: called inside a catch block.
std::string current_exception_message();

// Whether an exception's message says an operation timed out (LibTorch 1.13 and 2.x, Gloo).
bool is_timeout_message(std::string_view what);

// The exception being handled as a Status: DeadlineExceeded when its message is a timeout, else
// `code`; its message after "`context`: " when `context` is not empty.
// REQUIRES: called inside a catch block.
absl::Status current_exception_status(absl::StatusCode code, std::string_view context = "");

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_EXCEPTION_STATUS_H_
