#include "checkpoint/zip_check.h"

#include <zlib.h>

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"

namespace dtrain::checkpoint {
namespace {

constexpr uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kEocdSig = 0x06054b50;
constexpr uint32_t kZip64EocdSig = 0x06064b50, kZip64LocatorSig = 0x07064b50;
constexpr size_t kEocdSize = 22, kCentralSize = 46, kLocalSize = 30;

// Little-endian reads that fail instead of reading past the end.
struct Reader {
  std::string_view b;
  bool has(uint64_t at, uint64_t n) const { return at <= b.size() && n <= b.size() - at; }
  uint64_t le(uint64_t at, int n) const {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[at + static_cast<size_t>(i)]);
    return v;
  }
};

}  // namespace

uint32_t crc32_of(const char* data, uint64_t size) {
  uLong crc = crc32(0L, Z_NULL, 0);
  constexpr uint64_t kPiece = uint64_t{1} << 30;
  for (uint64_t off = 0; off < size; off += kPiece) {
    crc = crc32(crc, reinterpret_cast<const Bytef*>(data + off), static_cast<uInt>(std::min(kPiece, size - off)));
  }
  return static_cast<uint32_t>(crc);
}

absl::StatusOr<ZipSummary> check_zip(std::string_view bytes, const std::string& name) {
  const Reader r{bytes};
  auto loss = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("state file ", name, " is damaged: ", what));
  };
  if (bytes.size() < kEocdSize) return loss(absl::StrCat("only ", bytes.size(), " bytes, too short for a zip"));
  // The EOCD record whose comment ends exactly at the end of the file.
  std::optional<size_t> eocd;
  const size_t lowest = bytes.size() >= kEocdSize + 0xffff ? bytes.size() - kEocdSize - 0xffff : 0;
  for (size_t p = bytes.size() - kEocdSize + 1; p-- > lowest;) {
    if (r.le(p, 4) == kEocdSig && p + kEocdSize + r.le(p + 20, 2) == bytes.size()) {
      eocd = p;
      break;
    }
  }
  if (!eocd) {
    return loss("no end-of-central-directory record ends at the end of the file (truncated, or bytes were "
                "appended or overwritten at its end)");
  }
  const size_t e = *eocd;
  if (r.le(e + 4, 2) != 0 || r.le(e + 6, 2) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("state file ", name, " is a multi-disk zip, which dtrain does not read"));
  }
  uint64_t entries = r.le(e + 10, 2), cd_size = r.le(e + 12, 4), cd_offset = r.le(e + 16, 4);
  if (entries == 0xffff || cd_size == 0xffffffffu || cd_offset == 0xffffffffu) {
    if (e < 20 || r.le(e - 20, 4) != kZip64LocatorSig) return loss("zip64 sizes without a zip64 locator");
    const uint64_t z = r.le(e - 20 + 8, 8);
    if (!r.has(z, 56) || r.le(z, 4) != kZip64EocdSig) return loss("the zip64 end record is out of bounds");
    entries = r.le(z + 32, 8);
    cd_size = r.le(z + 40, 8);
    cd_offset = r.le(z + 48, 8);
  }
  if (!r.has(cd_offset, cd_size) || cd_offset + cd_size > e) return loss("the central directory is out of bounds");
  uint64_t at = cd_offset;
  for (uint64_t i = 0; i < entries; ++i) {
    if (!r.has(at, kCentralSize) || r.le(at, 4) != kCentralSig || at + kCentralSize > cd_offset + cd_size) {
      return loss(absl::StrCat("central-directory entry ", i, " of ", entries, " is missing or out of bounds"));
    }
    const uint64_t flags = r.le(at + 8, 2), method = r.le(at + 10, 2), crc = r.le(at + 16, 4);
    uint64_t comp = r.le(at + 20, 4), size = r.le(at + 24, 4), local = r.le(at + 42, 4);
    const uint64_t name_len = r.le(at + 28, 2), extra_len = r.le(at + 30, 2), comment_len = r.le(at + 32, 2);
    if (!r.has(at + kCentralSize, name_len + extra_len + comment_len)) return loss(absl::StrCat("entry ", i, "'s name is out of bounds"));
    const std::string entry(bytes.substr(at + kCentralSize, name_len));
    // Zip64 extra field: the 64-bit values of the fields set to 0xffffffff, in this order.
    for (uint64_t x = at + kCentralSize + name_len, end = x + extra_len; x + 4 <= end;) {
      const uint64_t id = r.le(x, 2), len = r.le(x + 2, 2);
      if (x + 4 + len > end) return loss(absl::StrCat("entry ", entry, " has a malformed extra field"));
      if (id == 1) {
        uint64_t y = x + 4;
        for (uint64_t* field : {&size, &comp, &local}) {
          if (*field != 0xffffffffu) continue;
          if (y + 8 > x + 4 + len) return loss(absl::StrCat("entry ", entry, " has a short zip64 field"));
          *field = r.le(y, 8);
          y += 8;
        }
      }
      x += 4 + len;
    }
    if ((flags & 1) != 0 || method != 0 || comp != size) {
      return absl::InvalidArgumentError(absl::StrCat("state file ", name, ": entry ", entry, " is ",
                                                     (flags & 1) != 0 ? "encrypted" : "compressed",
                                                     "; dtrain reads stored zips as torch.save writes them"));
    }
    if (!r.has(local, kLocalSize) || r.le(local, 4) != kLocalSig) {
      return loss(absl::StrCat("entry ", entry, "'s local header is missing or out of bounds"));
    }
    const uint64_t data = local + kLocalSize + r.le(local + 26, 2) + r.le(local + 28, 2);
    if (!r.has(data, size) || data + size > cd_offset) return loss(absl::StrCat("entry ", entry, "'s data is out of bounds"));
    if (crc32_of(bytes.data() + data, size) != crc) {
      return loss(absl::StrCat("entry ", entry, " fails its CRC-32 (corrupted bytes)"));
    }
    at += kCentralSize + name_len + extra_len + comment_len;
  }
  ZipSummary s;
  s.comment = bytes.substr(e + kEocdSize);
  s.eocd_offset = e;
  s.entries = static_cast<int64_t>(entries);
  return s;
}

}  // namespace dtrain::checkpoint
