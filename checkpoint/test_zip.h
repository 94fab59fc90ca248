// Test-only: builds zip archives of stored entries byte by byte, as torch.save lays them out, with
// knobs for what readers must cope with (zip64 records, comments, compressed-method entries).
//
//   std::string zip = dtrain::checkpoint::testing::make_zip({{"archive/data.pkl", pickle}});
//   ZipOptions o;
//   o.zip64 = true;
//   std::string z64 = make_zip({{"a/data.pkl", pickle}}, o);
#ifndef DTRAIN_CHECKPOINT_TEST_ZIP_H_
#define DTRAIN_CHECKPOINT_TEST_ZIP_H_

#include <zlib.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::checkpoint::testing {

struct ZipOptions {
  bool zip64 = false;   // zip64 extra fields, zip64 end record and locator, saturated 32-bit fields
  std::string comment;  // the end record's comment
  uint16_t method = 0;  // written into every header (the data stay as given)
  bool align64 = true;  // pad each entry's data to a multiple of 64 bytes ("FB" extra field)
};

inline void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

inline uint32_t crc_of(const std::string& data) {
  return static_cast<uint32_t>(
      crc32(0, reinterpret_cast<const Bytef*>(data.data()), static_cast<uInt>(data.size())));
}

inline std::string make_zip(const std::vector<std::pair<std::string, std::string>>& entries,
                            const ZipOptions& o = {}) {
  std::string out;
  std::vector<uint64_t> offsets;
  for (const auto& [name, data] : entries) {
    offsets.push_back(out.size());
    const uint64_t header_end = out.size() + 30 + name.size() + 4 + (o.zip64 ? 20 : 0);
    const uint64_t pad = o.align64 ? (64 - header_end % 64) % 64 : 0;
    put_le(out, 0x04034b50, 4);
    put_le(out, o.zip64 ? 45 : 20, 2);
    put_le(out, 0, 2);
    put_le(out, o.method, 2);
    put_le(out, 0, 4);  // time, date
    put_le(out, crc_of(data), 4);
    put_le(out, o.zip64 ? 0xffffffffu : data.size(), 4);
    put_le(out, o.zip64 ? 0xffffffffu : data.size(), 4);
    put_le(out, name.size(), 2);
    put_le(out, 4 + pad + (o.zip64 ? 20 : 0), 2);
    out += name;
    if (o.zip64) {
      put_le(out, 1, 2);
      put_le(out, 16, 2);
      put_le(out, data.size(), 8);
      put_le(out, data.size(), 8);
    }
    out += "FB";
    put_le(out, pad, 2);
    out.append(pad, 'Z');
    out += data;
  }
  const uint64_t cd_start = out.size();
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& [name, data] = entries[i];
    put_le(out, 0x02014b50, 4);
    put_le(out, o.zip64 ? 45 : 20, 2);
    put_le(out, o.zip64 ? 45 : 20, 2);
    put_le(out, 0, 2);
    put_le(out, o.method, 2);
    put_le(out, 0, 4);
    put_le(out, crc_of(data), 4);
    put_le(out, o.zip64 ? 0xffffffffu : data.size(), 4);
    put_le(out, o.zip64 ? 0xffffffffu : data.size(), 4);
    put_le(out, name.size(), 2);
    put_le(out, o.zip64 ? 28 : 0, 2);
    put_le(out, 0, 2);  // comment
    put_le(out, 0, 2);  // disk
    put_le(out, 0, 2);  // internal attributes
    put_le(out, 0, 4);  // external attributes
    put_le(out, o.zip64 ? 0xffffffffu : offsets[i], 4);
    out += name;
    if (o.zip64) {
      put_le(out, 1, 2);
      put_le(out, 24, 2);
      put_le(out, data.size(), 8);
      put_le(out, data.size(), 8);
      put_le(out, offsets[i], 8);
    }
  }
  const uint64_t cd_size = out.size() - cd_start;
  if (o.zip64) {
    const uint64_t z = out.size();
    put_le(out, 0x06064b50, 4);
    put_le(out, 44, 8);
    put_le(out, 45, 2);
    put_le(out, 45, 2);
    put_le(out, 0, 4);
    put_le(out, 0, 4);
    put_le(out, entries.size(), 8);
    put_le(out, entries.size(), 8);
    put_le(out, cd_size, 8);
    put_le(out, cd_start, 8);
    put_le(out, 0x07064b50, 4);
    put_le(out, 0, 4);
    put_le(out, z, 8);
    put_le(out, 1, 4);
  }
  put_le(out, 0x06054b50, 4);
  put_le(out, 0, 2);
  put_le(out, 0, 2);
  put_le(out, o.zip64 ? 0xffff : entries.size(), 2);
  put_le(out, o.zip64 ? 0xffff : entries.size(), 2);
  put_le(out, o.zip64 ? 0xffffffffu : cd_size, 4);
  put_le(out, o.zip64 ? 0xffffffffu : cd_start, 4);
  put_le(out, o.comment.size(), 2);
  out += o.comment;
  return out;
}

}  // namespace dtrain::checkpoint::testing

#endif  // DTRAIN_CHECKPOINT_TEST_ZIP_H_
