#include "comm/exception_status.h"

#include <exception>

#include <c10/util/Exception.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace dtrain::comm {

std::string current_exception_message() {
  try {
    throw;
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

bool is_timeout_message(std::string_view what) {
  const std::string lower = absl::AsciiStrToLower(std::string(what));
  return absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout");
}

absl::Status current_exception_status(absl::StatusCode code, std::string_view context) {
  const std::string what = current_exception_message();
  const std::string message =
      context.empty() ? what : absl::StrCat(std::string(context), ": ", what);
  return absl::Status(is_timeout_message(what) ? absl::StatusCode::kDeadlineExceeded : code,
                      message);
}

}  // namespace dtrain::comm
