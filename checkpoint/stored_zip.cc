#include "checkpoint/stored_zip.h"

#include <zlib.h>

#include <algorithm>
#include <unordered_set>

#include "absl/strings/str_cat.h"

namespace dtrain::checkpoint {
namespace {

constexpr uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kEocdSig = 0x06054b50;
constexpr uint32_t kZip64EocdSig = 0x06064b50, kZip64LocatorSig = 0x07064b50;
constexpr uint64_t kEocdSize = 22, kCentralSize = 46, kLocalSize = 30;
constexpr uint64_t kZip64EocdSize = 56, kZip64LocatorSize = 20;
constexpr uint64_t kMax32 = 0xffffffffu, kMax16 = 0xffffu;

// Little-endian reads of fields whose bounds the caller checked with has().
class Bytes {
 public:
  explicit Bytes(std::string_view b) : b_(b) {}
  uint64_t size() const { return b_.size(); }
  // Whether [at, at + n) lies inside the bytes (no overflow for any at, n).
  bool has(uint64_t at, uint64_t n) const { return at <= b_.size() && n <= b_.size() - at; }
  uint64_t le(uint64_t at, int n) const {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i)
      v = (v << 8) | static_cast<unsigned char>(b_[at + static_cast<uint64_t>(i)]);
    return v;
  }
  std::string_view view(uint64_t at, uint64_t n) const { return b_.substr(at, n); }

 private:
  std::string_view b_;
};

class Parser {
 public:
  Parser(std::string_view bytes, const std::string& name) : bytes_(bytes), b_(bytes), name_(name) {}

  absl::StatusOr<StoredZip> parse(bool verify_crcs) {
    if (b_.size() < kEocdSize) {
      return loss(absl::StrCat("only ", b_.size(), " bytes, too short for a zip archive (at least ",
                               kEocdSize, ")"));
    }
    const std::optional<uint64_t> end = find_end_record(bytes_);
    if (!end) {
      return loss(
          "no end-of-central-directory record ends at the end of the file: it was truncated, or "
          "bytes were appended after its end (a zip archive must end with that record and its "
          "comment)");
    }
    const uint64_t e = *end;
    if (b_.le(e + 4, 2) != 0 || b_.le(e + 6, 2) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, " is a multi-disk zip archive, which dtrain does not read"));
    }
    uint64_t count = b_.le(e + 10, 2), cd_size = b_.le(e + 12, 4), cd_offset = b_.le(e + 16, 4);
    uint64_t cd_limit = e;  // the central directory ends before this
    const bool has_locator =
        e >= kZip64LocatorSize && b_.le(e - kZip64LocatorSize, 4) == kZip64LocatorSig;
    if (has_locator) {
      const uint64_t loc = e - kZip64LocatorSize;
      const uint64_t z = b_.le(loc + 8, 8);
      if (!b_.has(z, kZip64EocdSize) || z + kZip64EocdSize > loc || b_.le(z, 4) != kZip64EocdSig) {
        return loss("its zip64 end-of-central-directory record is missing or out of bounds");
      }
      if (b_.le(z + 16, 4) != 0 || b_.le(z + 20, 4) != 0 || b_.le(loc + 4, 4) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(name_, " is a multi-disk zip64 archive, which dtrain does not read"));
      }
      count = b_.le(z + 32, 8);
      cd_size = b_.le(z + 40, 8);
      cd_offset = b_.le(z + 48, 8);
      cd_limit = z;
    } else if (count == kMax16 || cd_size == kMax32 || cd_offset == kMax32) {
      return loss("its end record defers to zip64 values but there is no zip64 locator before it");
    }
    if (!b_.has(cd_offset, cd_size) || cd_offset + cd_size > cd_limit) {
      return loss(absl::StrCat("its central directory (", cd_size, " bytes at offset ", cd_offset,
                               ") lies outside the file or overlaps its end records"));
    }
    if (count > cd_size / kCentralSize) {
      return loss(absl::StrCat("its end record announces ", count,
                               " entries, more than a central directory of ", cd_size,
                               " bytes can hold"));
    }
    StoredZip zip;
    zip.entries.reserve(static_cast<size_t>(count));
    const uint64_t cd_end = cd_offset + cd_size;
    uint64_t at = cd_offset;
    std::vector<std::pair<uint64_t, uint64_t>> spans;  // [local header, end of data) of each entry
    spans.reserve(static_cast<size_t>(count));
    for (uint64_t i = 0; i < count; ++i) {
      absl::StatusOr<uint64_t> next = entry(at, cd_end, cd_offset, i, count, zip, spans);
      if (!next.ok()) return next.status();
      at = *next;
    }
    if (absl::Status st = check_entries(zip, spans, verify_crcs); !st.ok()) return st;
    zip.comment = b_.view(e + kEocdSize, b_.size() - e - kEocdSize);
    zip.eocd_offset = e;
    return zip;
  }

 private:
  absl::Status loss(const std::string& what) const {
    return absl::DataLossError(absl::StrCat(name_, " is damaged: ", what));
  }

  // The entries' names are unique, their bytes (`spans`: [local header, end of data) of each) do
  // not overlap, and, with `verify_crcs`, their data matches its CRC-32.
  absl::Status check_entries(const StoredZip& zip,
                             std::vector<std::pair<uint64_t, uint64_t>>& spans,
                             bool verify_crcs) const {
    std::unordered_set<std::string_view> names;
    for (const ZipEntry& entry : zip.entries) {
      if (!names.insert(entry.name).second)
        return loss(absl::StrCat("the entry name ", entry.name, " occurs twice"));
    }
    // Entries never share bytes (a real zip's do not; overlapping ones would make the CRC checks
    // below quadratic and let two tensors alias): checked before any CRC is computed.
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i) {
      if (spans[i].first < spans[i - 1].second) {
        return loss(absl::StrCat("two entries overlap at offset ", spans[i].first));
      }
    }
    if (verify_crcs) {
      for (const ZipEntry& entry : zip.entries) {
        if (crc32_of(entry.data) != entry.crc32) {
          return loss(absl::StrCat("entry ", entry.name,
                                   " fails its CRC-32 check (its bytes are corrupted)"));
        }
      }
    }
    return absl::OkStatus();
  }

  // Zip64 extended information (id 1) in entry `name`'s extra field of `extra_len` bytes at `at`:
  // 64-bit values of the fields set to 0xffffffff, in the order uncompressed size, compressed
  // size, local header offset. *found: whether the field is there.
  absl::Status read_zip64_extra(uint64_t at, uint64_t extra_len, const std::string& name,
                                uint64_t& size, uint64_t& comp, uint64_t& local,
                                bool* found) const {
    for (uint64_t x = at, end = x + extra_len; x + 4 <= end;) {
      const uint64_t id = b_.le(x, 2), len = b_.le(x + 2, 2);
      if (x + 4 + len > end)
        return loss(absl::StrCat("entry ", name, " has a malformed extra field"));
      if (id == 1) {
        *found = true;
        uint64_t y = x + 4;
        for (uint64_t* field : {&size, &comp, &local}) {
          if (*field != kMax32) continue;
          if (y + 8 > x + 4 + len)
            return loss(absl::StrCat("entry ", name, "'s zip64 extra field is too short"));
          *field = b_.le(y, 8);
          y += 8;
        }
      }
      x += 4 + len;
    }
    return absl::OkStatus();
  }

  // Parses central-directory entry `i` at `at`, appends it to zip.entries, returns the next offset.
  absl::StatusOr<uint64_t> entry(uint64_t at, uint64_t cd_end, uint64_t data_limit, uint64_t i,
                                 uint64_t count, StoredZip& zip,
                                 std::vector<std::pair<uint64_t, uint64_t>>& spans) {
    if (!b_.has(at, kCentralSize) || at + kCentralSize > cd_end || b_.le(at, 4) != kCentralSig) {
      return loss(absl::StrCat("central-directory entry ", i + 1, " of ", count,
                               " is missing or out of bounds"));
    }
    const uint64_t flags = b_.le(at + 8, 2), method = b_.le(at + 10, 2), crc = b_.le(at + 16, 4);
    uint64_t comp = b_.le(at + 20, 4), size = b_.le(at + 24, 4), local = b_.le(at + 42, 4);
    const uint64_t disk = b_.le(at + 34, 2);
    const uint64_t name_len = b_.le(at + 28, 2), extra_len = b_.le(at + 30, 2),
                   comment_len = b_.le(at + 32, 2);
    const uint64_t var_len = name_len + extra_len + comment_len;  // < 2^18: no overflow
    if (at + kCentralSize + var_len > cd_end) {
      return loss(absl::StrCat("central-directory entry ", i + 1, " of ", count,
                               "'s name, extra field or comment runs past the central directory"));
    }
    std::string name(b_.view(at + kCentralSize, name_len));
    bool zip64_field = false;
    if (absl::Status st = read_zip64_extra(at + kCentralSize + name_len, extra_len, name, size,
                                           comp, local, &zip64_field);
        !st.ok())
      return st;
    if (!zip64_field && (size == kMax32 || comp == kMax32 || local == kMax32)) {
      return loss(
          absl::StrCat("entry ", name, " defers its sizes or offset to a zip64 field it lacks"));
    }
    if ((flags & 1) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": entry ", name,
                       " is encrypted; dtrain reads "
                       "unencrypted zip archives as torch.save writes them"));
    }
    if (method != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          name_, ": entry ", name, " is compressed (zip method ", method,
          "); dtrain reads stored (uncompressed) "
          "entries, as torch.save writes them: load the file in Python and torch.save it again"));
    }
    if (disk != 0)
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": entry ", name, " is on another disk"));
    if (comp != size) {
      return loss(absl::StrCat("stored entry ", name, " has a compressed size (", comp,
                               ") different from its size (", size, ")"));
    }
    if (!b_.has(local, kLocalSize) || b_.le(local, 4) != kLocalSig) {
      return loss(absl::StrCat("entry ", name, "'s local header (offset ", local,
                               ") is missing or out of bounds"));
    }
    const uint64_t local_name_len = b_.le(local + 26, 2), local_extra_len = b_.le(local + 28, 2);
    if (!b_.has(local + kLocalSize, local_name_len) ||
        b_.view(local + kLocalSize, local_name_len) != std::string_view(name)) {
      return loss(absl::StrCat("entry ", name, "'s local header names another file"));
    }
    const uint64_t data =
        local + kLocalSize + local_name_len + local_extra_len;  // < 2^64: local < size
    if (!b_.has(data, size) || data + size > data_limit) {
      return loss(
          absl::StrCat("entry ", name, "'s ", size, " bytes of data at offset ", data,
                       " run past the start of the central directory (truncated or overwritten)"));
    }
    ZipEntry entry;
    entry.data = b_.view(data, size);
    entry.crc32 = static_cast<uint32_t>(crc);
    spans.emplace_back(local, data + size);
    entry.name = std::move(name);
    zip.entries.push_back(std::move(entry));
    return at + kCentralSize + var_len;
  }

  std::string_view bytes_;
  Bytes b_;
  const std::string& name_;
};

}  // namespace

std::optional<uint64_t> find_end_record(std::string_view bytes) {
  const Bytes b(bytes);
  if (b.size() < kEocdSize) return std::nullopt;
  const uint64_t lowest = b.size() >= kEocdSize + kMax16 ? b.size() - kEocdSize - kMax16 : 0;
  for (uint64_t p = b.size() - kEocdSize + 1; p-- > lowest;) {
    if (b.le(p, 4) == kEocdSig && p + kEocdSize + b.le(p + 20, 2) == b.size()) return p;
  }
  return std::nullopt;
}

uint32_t crc32_of(std::string_view data, uint32_t crc) {
  uLong c = crc;
  constexpr size_t kPiece = size_t{1} << 30;
  for (size_t off = 0; off < data.size(); off += kPiece) {
    c = crc32(c, reinterpret_cast<const Bytef*>(data.data() + off),
              static_cast<uInt>(std::min(kPiece, data.size() - off)));
  }
  return static_cast<uint32_t>(c);
}

absl::StatusOr<StoredZip> read_stored_zip(std::string_view bytes,
                                          const std::string& name_for_errors, bool verify_crcs) {
  return Parser(bytes, name_for_errors).parse(verify_crcs);
}

}  // namespace dtrain::checkpoint
