#include "checkpoint/state_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <random>
#include <string_view>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/container_types.h"
#include "checkpoint/stored_zip.h"
#include "checkpoint/torch_file_reader.h"
#include "checkpoint/torch_file_writer.h"

namespace dtrain::checkpoint {
namespace {

// Memory for a whole file, that the tensors read from it then view. A large buffer is its own
// anonymous mapping, 2 MiB aligned and advised as transparent huge pages where the kernel allows
// them (THP "madvise" or "always"): a fresh page costs a fault on first touch, and faulting 160
// MiB in 4 KiB pages made reading it take about 4 times as long as with 2 MiB pages
// (checkpoint_benchmark's BM_LoadPythonWritten). Without huge pages it is an ordinary mapping.
// Uninitialised (no pass to zero it); nullptr when the memory cannot be had.
std::shared_ptr<char> file_buffer(size_t size) {
  constexpr size_t kHuge = size_t{2} << 20;
  if (size < kHuge) {
    char* small = new (std::nothrow) char[std::max<size_t>(size, 1)];
    if (small == nullptr) return nullptr;
    return std::shared_ptr<char>(small, std::default_delete<char[]>());
  }
  // Mapped with a 2 MiB margin, then trimmed to a 2 MiB-aligned, 2 MiB-multiple region.
  const size_t length = (size + kHuge - 1) / kHuge * kHuge;
  void* raw =
      ::mmap(nullptr, length + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHuge - 1) / kHuge * kHuge;
  if (aligned > start) ::munmap(raw, aligned - start);
  if (const uintptr_t end = start + length + kHuge, used = aligned + length; end > used) {
    ::munmap(reinterpret_cast<void*>(used), end - used);
  }
  char* data = reinterpret_cast<char*>(aligned);
  ::madvise(data, length, MADV_HUGEPAGE);  // advice only: EINVAL without THP changes nothing
  return std::shared_ptr<char>(data, [length](char* p) { ::munmap(p, length); });
}

// The zip end-of-central-directory record is the last 22 bytes of a comment-less zip; its last
// two bytes hold the comment length. The comment carries our trailer.
constexpr size_t kEocdSize = 22;
constexpr char kTrailerPrefix[] = "dtrain-state-file v1 crc32=";

absl::Status os_error(const std::string& what, const std::string& path) {
  const int err = errno;
  const std::string msg = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM || err == EROFS) return absl::PermissionDeniedError(msg);
  return absl::UnavailableError(msg);
}

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}
bool contains(std::string_view s, std::string_view part) {
  return s.find(part) != std::string_view::npos;
}

constexpr char kUseAnotherCopy[] =
    "The file cannot be used as it is: load another copy, or save it again";

std::string printable(std::string_view s) {
  std::string out;
  for (char c : s) out.push_back(c >= 0x20 && c < 0x7f ? c : '?');
  return out;
}

// What the end record's comment is: nothing (torch.save), dtrain's trailer (exactly its grammar),
// a damaged trailer (close to it: a single damaged byte or bit anywhere in it is caught), or a
// comment of another zip tool (nothing like it).
enum class Comment { kNone, kTrailer, kDamaged, kForeign };

struct Trailer {
  uint32_t crc = 0;
  uint64_t size = 0;
};

// Parses exactly kTrailerPrefix, 8 lowercase hex digits, " size=", 1-20 decimal digits.
std::optional<Trailer> parse_trailer(std::string_view c) {
  const std::string_view prefix = kTrailerPrefix;
  if (!starts_with(c, prefix)) return std::nullopt;
  c.remove_prefix(prefix.size());
  Trailer t;
  if (c.size() < 8) return std::nullopt;
  for (char h : c.substr(0, 8)) {
    const int digit = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : -1;
    if (digit < 0) return std::nullopt;
    t.crc = (t.crc << 4) | static_cast<uint32_t>(digit);
  }
  c.remove_prefix(8);
  if (!starts_with(c, " size=")) return std::nullopt;
  c.remove_prefix(6);
  if (c.empty() || c.size() > 20 || (c.size() > 1 && c[0] == '0')) return std::nullopt;
  for (char d : c) {
    if (d < '0' || d > '9') return std::nullopt;
  }
  if (!absl::SimpleAtoi(std::string(c), &t.size)) return std::nullopt;
  return t;
}

Comment classify(std::string_view comment) {
  if (comment.empty()) return Comment::kNone;
  if (parse_trailer(comment)) return Comment::kTrailer;
  const std::string_view prefix = kTrailerPrefix;
  size_t same = 0;
  for (size_t i = 0; i < std::min(prefix.size(), comment.size()); ++i)
    same += comment[i] == prefix[i];
  const bool close = 2 * same >= prefix.size() || contains(comment, "dtrain-state") ||
                     contains(comment, " crc32=") || contains(comment, " size=");
  return close ? Comment::kDamaged : Comment::kForeign;
}

absl::Status verify_trailer(std::string_view all, uint64_t eocd, std::string_view comment,
                            const std::string& name) {
  const Trailer t = *parse_trailer(comment);
  const uint64_t content = eocd + kEocdSize;  // the bytes the checksum covers
  if (t.size != content) {
    return absl::DataLossError(absl::StrCat(name, " is damaged: its trailer says ", t.size,
                                            " bytes of zip precede it, the file has ", content,
                                            ". ", kUseAnotherCopy));
  }
  // The checksum was taken with the comment length still 0: the last two bytes before the comment.
  static constexpr char kZeroLength[2] = {0, 0};
  const uint32_t actual =
      crc32_of(std::string_view(kZeroLength, 2), crc32_of(all.substr(0, content - 2)));
  if (actual != t.crc) {
    return absl::DataLossError(
        absl::StrFormat("%s is corrupted: checksum %08x, expected %08x (its trailer). %s", name,
                        actual, t.crc, kUseAnotherCopy));
  }
  return absl::OkStatus();
}

// For a file whose zip structure is broken: when an end record followed by something like a
// dtrain trailer sits near the end, says how the trailer fails to end the file.
absl::Status misplaced_trailer(std::string_view all, const std::string& name) {
  const size_t lowest =
      all.size() > kEocdSize + 0xffff + 64 ? all.size() - kEocdSize - 0xffff - 64 : 0;
  for (size_t p = all.size() >= kEocdSize ? all.size() - kEocdSize + 1 : 0; p-- > lowest;) {
    if (all.compare(p, 4, "PK\x05\x06") != 0) continue;
    const std::string_view after = all.substr(p + kEocdSize);
    const size_t announced =
        static_cast<unsigned char>(all[p + 20]) | static_cast<unsigned char>(all[p + 21]) << 8;
    const std::string_view prefix =
        std::string_view(kTrailerPrefix).substr(0, std::min<size_t>(after.size(), 10));
    if (after.empty() ? announced == 0 : !starts_with(after, prefix)) continue;
    return absl::DataLossError(absl::StrCat(
        name,
        " is damaged: its dtrain trailer does not end the file: the zip's end record announces a ",
        announced, "-byte comment but ", after.size(), " bytes follow it (",
        after.size() < announced ? "the file was cut inside its trailer"
                                 : "bytes were appended after its trailer",
        ", or the record is damaged). ", kUseAnotherCopy));
  }
  return absl::OkStatus();
}

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::Status save_state(const std::string& path, const c10::IValue& state,
                        const SaveOptions& options) {
  // dtrain's own writer: the file Python's torch.save would write, which torch.load reads with
  // weights_only=True (LibTorch's pickle_save adds globals PyTorch 2.6's default load refuses).
  absl::StatusOr<std::string> written = write_torch_file(state);
  if (!written.ok()) {
    return absl::Status(
        written.status().code(),
        absl::StrCat("cannot serialize the state for ", path, ": ", written.status().message()));
  }
  std::vector<char> bytes(written->begin(), written->end());
  written->clear();
  if (bytes.size() < kEocdSize ||
      std::memcmp(bytes.data() + bytes.size() - kEocdSize, "PK\x05\x06", 4) != 0 ||
      bytes[bytes.size() - 2] != 0 || bytes[bytes.size() - 1] != 0) {
    return absl::InternalError(
        "the zip writer produced an unexpected layout (no plain zip trailer)");
  }
  const std::string trailer =
      absl::StrFormat("%s%08x size=%d", kTrailerPrefix,
                      crc32_of(std::string_view(bytes.data(), bytes.size())), bytes.size());
  bytes[bytes.size() - 2] = static_cast<char>(trailer.size() & 0xff);
  bytes[bytes.size() - 1] = static_cast<char>(trailer.size() >> 8);
  bytes.insert(bytes.end(), trailer.begin(), trailer.end());

  std::random_device rd;
  const std::string tmp = absl::StrFormat("%s.tmp.%d.%08x", path, ::getpid(), rd());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return os_error("cannot create", tmp);
  auto fail = [&](const std::string& what, const std::string& p) {
    absl::Status s = os_error(what, p);
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  };
  const int64_t chunk = std::max<int64_t>(1, options.write_chunk_bytes);
  for (size_t off = 0; off < bytes.size();) {
    const size_t want = std::min<size_t>(static_cast<size_t>(chunk), bytes.size() - off);
    const ssize_t n = ::write(fd, bytes.data() + off, want);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail("cannot write", tmp);
    }
    off += static_cast<size_t>(n);
    if (options.after_chunk) options.after_chunk(static_cast<int64_t>(off));
  }
  if (::fsync(fd) != 0) return fail("cannot fsync", tmp);
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return os_error("cannot close", tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status s = os_error("cannot rename the temporary file onto", path);
    ::unlink(tmp.c_str());
    return s;
  }
  // Make the rename itself durable.
  const std::string dir = dir_of(path);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

absl::StatusOr<c10::IValue> load_state(const std::string& path, const LoadOptions& load_options) {
  // O_NONBLOCK: a FIFO (or another special file) at `path` must not block the open.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT)
      return absl::NotFoundError(absl::StrCat("state file ", path, " does not exist"));
    return os_error("cannot open", path);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    absl::Status s = os_error("cannot stat", path);
    ::close(fd);
    return s;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("state file ", path,
                     " is not a regular file (a directory, FIFO "
                     "or device); give the path of a checkpoint file"));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  // Shared: the tensors read are views into it (no second copy).
  const size_t size = static_cast<size_t>(st.st_size);
  std::shared_ptr<char> buffer = file_buffer(size);
  if (buffer == nullptr) {
    ::close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", size, " bytes to read state file ", path));
  }
  const std::string_view bytes(buffer.get(), size);
  for (size_t off = 0; off < bytes.size();) {
    const ssize_t n = ::read(fd, buffer.get() + off, bytes.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status s =
          n < 0
              ? os_error("cannot read", path)
              : absl::DataLossError(absl::StrCat("state file ", path, " shrank while being read"));
      ::close(fd);
      return s;
    }
    off += static_cast<size_t>(n);
  }
  ::close(fd);

  // The zip's own structure decides whether a trailer is there: the end record that ends the file
  // carries it as its comment. Nothing is searched for, so no damage can hide a trailer.
  const std::string_view all = bytes;
  const std::string name = absl::StrCat("state file ", path);
  const std::optional<uint64_t> eocd = find_end_record(all);
  if (!eocd) {
    if (absl::Status trailer = misplaced_trailer(all, name); !trailer.ok()) return trailer;
    return read_torch_file(all, name);  // its error: legacy format, not a zip, truncated
  }
  const std::string_view comment = all.substr(*eocd + kEocdSize);
  TorchFileReadOptions options;
  options.owner = buffer;
  options.map_location = load_options.map_location;
  switch (classify(comment)) {
    case Comment::kNone:     // torch.save's files: every entry's CRC-32 is verified by the reader
    case Comment::kForeign:  // a comment some other zip tool wrote: likewise
      break;
    case Comment::kDamaged:
      return absl::DataLossError(
          absl::StrCat(name, " is damaged: its dtrain trailer (the zip comment) is malformed: \"",
                       printable(comment.substr(0, 80)), "\". ", kUseAnotherCopy));
    case Comment::kTrailer:
      if (absl::Status s = verify_trailer(all, *eocd, comment, name); !s.ok()) return s;
      options.verify_entry_crcs = false;  // the whole file's CRC-32 just covered every entry
      break;
  }
  absl::StatusOr<c10::IValue> state = read_torch_file(all, name, options);
  if (state.ok()) type_homogeneous_containers(*state);
  return state;
}

}  // namespace dtrain::checkpoint
