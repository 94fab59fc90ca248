// torch_file_writer's zip: stored (uncompressed) entries, each one's data 64-byte aligned as
// PyTorch's writer aligns them, zip64 records where a field needs them (or always, when forced).
// Internal to checkpoint/.
//
//   ZipWriter zip("archive", /*force_zip64=*/false, /*reserve=*/bytes);
//   zip.add("data.pkl", pickle.data(), pickle.size());
//   std::string file = zip.finish();
#ifndef DTRAIN_CHECKPOINT_INTERNAL_ZIP_WRITER_H_
#define DTRAIN_CHECKPOINT_INTERNAL_ZIP_WRITER_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "checkpoint/stored_zip.h"

namespace dtrain::checkpoint::internal {

// The largest value a 32-bit zip field holds (above it, zip64 records).
inline constexpr uint64_t kMax32 = 0xffffffffu;

// Appends v's low `bytes` bytes, little-endian.
inline void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Little-endian fields {value, bytes}, in order.
inline void put_fields(std::string& out, std::initializer_list<std::pair<uint64_t, int>> fields) {
  for (const auto& [v, bytes] : fields) put_le(out, v, bytes);
}

// A zip of stored entries, each one's data 64-byte aligned, zip64 where a field needs it.
class ZipWriter {
 public:
  ZipWriter(std::string prefix, bool force_zip64, size_t reserve)
      : prefix_(std::move(prefix)), force_(force_zip64) {
    out_.reserve(reserve);
  }

  void add(const std::string& name, const char* data, size_t size) {
    Entry e{prefix_ + "/" + name, crc32_of(std::string_view(data, size)), size, out_.size()};
    const bool zip64 = force_ || size >= kMax32;
    const size_t zip64_extra = zip64 ? 20 : 0;  // id, length, uncompressed and compressed sizes
    const size_t pad = (64 - (out_.size() + 30 + e.name.size() + zip64_extra + 4) % 64) % 64;
    const uint64_t size32 = zip64 ? kMax32 : size;
    // Signature, version needed, flags (UTF-8 names, as PyTorch's writer), stored, time, date
    // (1980-01-01), CRC-32, compressed and uncompressed size, name length, extra length.
    put_fields(out_, {{0x04034b50, 4},
                      {zip64 ? 45 : 20, 2},
                      {0x0800, 2},
                      {0, 2},
                      {0, 2},
                      {0x21, 2},
                      {e.crc, 4},
                      {size32, 4},
                      {size32, 4},
                      {e.name.size(), 2},
                      {zip64_extra + 4 + pad, 2}});
    out_ += e.name;
    if (zip64) put_fields(out_, {{0x0001, 2}, {16, 2}, {size, 8}, {size, 8}});
    out_ += "FB";  // PyTorch's padding field: the data starts at a multiple of 64
    put_le(out_, pad, 2);
    out_.append(pad, 'Z');
    if (size > 0) out_.append(data, size);
    entries_.push_back(std::move(e));
  }

  std::string finish() {
    const uint64_t cd_start = out_.size();
    for (const Entry& e : entries_) {
      const bool big_size = force_ || e.size >= kMax32, big_offset = force_ || e.offset >= kMax32;
      const size_t extra =
          (big_size || big_offset) ? 4 + (big_size ? 16 : 0) + (big_offset ? 8 : 0) : 0;
      const uint64_t version = extra > 0 ? 45 : 20, size32 = big_size ? kMax32 : e.size;
      // Signature, made by (MS-DOS), needed, flags, method, time, date, CRC-32, sizes, name,
      // extra and comment lengths, disk, internal and external attributes, local header offset.
      put_fields(out_, {{0x02014b50, 4},
                        {version, 2},
                        {version, 2},
                        {0x0800, 2},
                        {0, 2},
                        {0, 2},
                        {0x21, 2},
                        {e.crc, 4},
                        {size32, 4},
                        {size32, 4},
                        {e.name.size(), 2},
                        {extra, 2},
                        {0, 2},
                        {0, 2},
                        {0, 2},
                        {0, 4},
                        {big_offset ? kMax32 : e.offset, 4}});
      out_ += e.name;
      if (extra > 0) {  // zip64 extended information: only the fields set to 0xFFFFFFFF, in order
        put_fields(out_, {{0x0001, 2}, {extra - 4, 2}});
        if (big_size) put_fields(out_, {{e.size, 8}, {e.size, 8}});
        if (big_offset) put_le(out_, e.offset, 8);
      }
    }
    const uint64_t cd_size = out_.size() - cd_start, count = entries_.size();
    const bool big_count = force_ || count >= 0xffff, big_cd_size = force_ || cd_size >= kMax32,
               big_cd_start = force_ || cd_start >= kMax32;
    if (big_count || big_cd_size || big_cd_start) {
      // Zip64 end of central directory record (size 44 after its first 12 bytes), then locator.
      const uint64_t record = out_.size();
      put_fields(out_, {{0x06064b50, 4},
                        {44, 8},
                        {45, 2},
                        {45, 2},
                        {0, 4},
                        {0, 4},
                        {count, 8},
                        {count, 8},
                        {cd_size, 8},
                        {cd_start, 8},
                        {0x07064b50, 4},
                        {0, 4},
                        {record, 8},
                        {1, 4}});
    }
    // End of central directory, comment length 0: the caller may set it and append a comment.
    const uint64_t count16 = big_count ? 0xffff : count;
    put_fields(out_, {{0x06054b50, 4},
                      {0, 2},
                      {0, 2},
                      {count16, 2},
                      {count16, 2},
                      {big_cd_size ? kMax32 : cd_size, 4},
                      {big_cd_start ? kMax32 : cd_start, 4},
                      {0, 2}});
    return std::move(out_);
  }

  // Upper bound of what add() and finish() write for an entry, beyond its data.
  static size_t overhead(size_t name_size) { return 2 * (46 + name_size + 28) + 30 + 20 + 4 + 63; }

 private:
  struct Entry {
    std::string name;
    uint32_t crc;
    uint64_t size;
    uint64_t offset;
  };
  std::string prefix_;
  bool force_;
  std::string out_;
  std::vector<Entry> entries_;
};

}  // namespace dtrain::checkpoint::internal

#endif  // DTRAIN_CHECKPOINT_INTERNAL_ZIP_WRITER_H_
