// Reads the zip container of a PyTorch file (what `torch.save` and LibTorch write) held in memory,
// without miniz or any other zip library: the end-of-central-directory record must end exactly at
// the end of the bytes (its comment length matching exactly), zip64 records are followed, every
// offset and length is bounds-checked with overflow-safe arithmetic before it is used, local
// headers are read for their own name/extra lengths, only stored (uncompressed) entries are taken,
// and every entry's CRC-32 is verified on request. Nothing is allocated from a length field beyond
// the entries' names; the entries' data are views into the caller's bytes.
//
//   absl::StatusOr<StoredZip> zip = dtrain::checkpoint::read_stored_zip(bytes, "state file a.pt");
//   if (!zip.ok()) return zip.status();   // DataLoss/InvalidArgument naming "state file a.pt"
//   for (const ZipEntry& e : zip->entries) use(e.name, e.data);
//   if (!zip->comment.empty()) ...        // dtrain's trailer lives there (checkpoint/state_file.cc)
#ifndef DTRAIN_CHECKPOINT_STORED_ZIP_H_
#define DTRAIN_CHECKPOINT_STORED_ZIP_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace dtrain::checkpoint {

struct ZipEntry {
  std::string name;       // as in the central directory (equal to the local header's)
  std::string_view data;  // the stored bytes: a view into the bytes given to read_stored_zip
  uint32_t crc32 = 0;     // as recorded in the central directory
};

struct StoredZip {
  std::vector<ZipEntry> entries;  // central-directory order; names are unique
  std::string_view comment;       // the end record's comment (a view into the bytes)
  uint64_t eocd_offset = 0;       // where the 22-byte end-of-central-directory record starts
};

// Parses `bytes` as a zip of stored entries. `name_for_errors` is how messages refer to the bytes
// ("state file /ckpt/a.pt"). With verify_crcs, every entry's data is checked against its CRC-32.
// Errors: DataLoss for damaged bytes (no end record ending the bytes -- truncated or bytes appended
// --, offsets or lengths out of bounds, a local header that disagrees with the central directory,
// duplicate names, a CRC mismatch): the message names the entry and what is wrong.
// InvalidArgument for well-formed zips dtrain does not read: compressed or encrypted entries,
// multi-disk archives. Thread safety: a pure function of its arguments.
absl::StatusOr<StoredZip> read_stored_zip(std::string_view bytes,
                                          const std::string& name_for_errors,
                                          bool verify_crcs = true);

// Where the end-of-central-directory record that ends `bytes` exactly starts (its comment running
// to the last byte), the one nearest the end when a comment holds another; nullopt when none does
// (truncated, bytes appended, not a zip). Its comment is bytes.substr(*offset + 22).
std::optional<uint64_t> find_end_record(std::string_view bytes);

// zlib's CRC-32 of `data` (any size; fed to zlib in pieces of at most 1 GiB), continuing from
// `crc` (0 to start).
uint32_t crc32_of(std::string_view data, uint32_t crc = 0);

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_STORED_ZIP_H_
