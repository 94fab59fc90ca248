// Structural and checksum verification of a zip file held in memory, before any other reader
// (LibTorch's miniz-based one) touches it: the end-of-central-directory record must end exactly at
// the end of the bytes (comment included), every central-directory entry and local header must lie
// inside them, every entry must be stored (uncompressed, as torch.save writes) and match its CRC-32.
// Zip64 records are followed. Every read is bounds-checked and overflow-safe; nothing is allocated
// from a length field.
//
//   absl::StatusOr<ZipSummary> z = dtrain::checkpoint::check_zip(bytes, path);
//   if (!z.ok()) return z.status();        // DataLoss naming `path` and what is wrong
//   if (absl::StartsWith(z->comment, "...")) ...
#ifndef DTRAIN_CHECKPOINT_ZIP_CHECK_H_
#define DTRAIN_CHECKPOINT_ZIP_CHECK_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace dtrain::checkpoint {

struct ZipSummary {
  std::string_view comment;   // the EOCD comment (a view into the checked bytes)
  size_t eocd_offset = 0;     // where the end-of-central-directory record starts
  int64_t entries = 0;
};

// The CRC-32 (zlib's, as zip uses) of `size` bytes at `data`, fed to zlib in pieces it can take.
uint32_t crc32_of(const char* data, uint64_t size);

// Errors: DataLoss (truncated, bytes appended, an entry out of bounds, a CRC mismatch: the message
// names `name`, the entry and what is wrong), InvalidArgument (a well-formed zip dtrain does not
// read: compressed or encrypted entries, multi-disk archives).
absl::StatusOr<ZipSummary> check_zip(std::string_view bytes, const std::string& name);

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_ZIP_CHECK_H_
