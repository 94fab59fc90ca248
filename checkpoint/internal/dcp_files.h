// Private to //checkpoint:dcp: what its save (dcp.cc) and read (dcp_reader.cc) halves share.
#ifndef DTRAIN_CHECKPOINT_INTERNAL_DCP_FILES_H_
#define DTRAIN_CHECKPOINT_INTERNAL_DCP_FILES_H_

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dtrain::checkpoint::dcp_internal {

inline constexpr char kMetadataFile[] = ".metadata";

// errno after a failed call on `path` as a Status: NotFound, PermissionDenied or Unavailable.
inline absl::Status os_error(const std::string& what, const std::string& path) {
  const int e = errno;
  const std::string msg = absl::StrCat(what, " ", path, ": ", std::strerror(e));
  if (e == ENOENT) return absl::NotFoundError(msg);
  if (e == EACCES || e == EPERM) return absl::PermissionDeniedError(msg);
  return absl::UnavailableError(msg);
}

}  // namespace dtrain::checkpoint::dcp_internal

#endif  // DTRAIN_CHECKPOINT_INTERNAL_DCP_FILES_H_
