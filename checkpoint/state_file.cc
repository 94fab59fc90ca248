#include "checkpoint/state_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/torch_zip_writer.h"
#include "checkpoint/zip_check.h"

namespace dtrain::checkpoint {
namespace {

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

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::Status save_state(const std::string& path, const c10::IValue& state, const SaveOptions& options) {
  // dtrain's own writer: the file Python's torch.save would write, which torch.load reads with
  // weights_only=True (LibTorch's pickle_save adds globals PyTorch 2.6's default load refuses).
  absl::StatusOr<std::string> written = write_torch_zip(state);
  if (!written.ok()) {
    return absl::Status(written.status().code(),
                        absl::StrCat("cannot serialize the state for ", path, ": ", written.status().message()));
  }
  std::vector<char> bytes(written->begin(), written->end());
  written->clear();
  if (bytes.size() < kEocdSize || std::memcmp(bytes.data() + bytes.size() - kEocdSize, "PK\x05\x06", 4) != 0 ||
      bytes[bytes.size() - 2] != 0 || bytes[bytes.size() - 1] != 0) {
    return absl::InternalError("the zip writer produced an unexpected layout (no plain zip trailer)");
  }
  const std::string trailer =
      absl::StrFormat("%s%08x size=%d", kTrailerPrefix, crc32_of(bytes.data(), bytes.size()), bytes.size());
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

absl::StatusOr<c10::IValue> load_state(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("state file ", path, " does not exist"));
    return os_error("cannot open", path);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    absl::Status s = os_error("cannot stat", path);
    ::close(fd);
    return s;
  }
  std::vector<char> bytes(static_cast<size_t>(st.st_size));
  for (size_t off = 0; off < bytes.size();) {
    const ssize_t n = ::read(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status s = n < 0 ? os_error("cannot read", path)
                             : absl::DataLossError(absl::StrCat("state file ", path, " shrank while being read"));
      ::close(fd);
      return s;
    }
    off += static_cast<size_t>(n);
  }
  ::close(fd);

  // Nothing reaches LibTorch's reader unverified: the zip's structure and every entry's CRC-32
  // first (the end record must end exactly at the end of the file), then our trailer when the
  // comment carries one.
  const std::string_view all(bytes.data(), bytes.size());
  if (bytes.size() >= 2 && static_cast<unsigned char>(bytes[0]) == 0x80 && bytes.size() >= 4 &&
      std::memcmp(bytes.data() + 2, "\x8a\x0a", 2) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state file ", path, " is in PyTorch's legacy (pre-1.6) format, which dtrain does not read: in Python, "
        "load it and save it again with torch.save(obj, path, _use_new_zipfile_serialization=True)"));
  }
  absl::StatusOr<ZipSummary> zip = check_zip(all, path);
  if (!zip.ok()) {
    // A dtrain trailer near the end that the zip structure does not account for: cut inside it,
    // bytes appended after it, or its length field damaged.
    if (all.substr(bytes.size() > 256 ? bytes.size() - 256 : 0).find("dtrain-state-file") == std::string_view::npos) {
      return zip.status();
    }
    return absl::DataLossError(absl::StrCat("state file ", path, " has a damaged or misplaced dtrain trailer (",
                                            zip.status().message(), ")"));
  }
  std::vector<char> content;
  if (zip->comment.substr(0, 17) == "dtrain-state-file") {
    const std::string prefix = kTrailerPrefix;
    const std::string trailer(zip->comment);
    unsigned crc = 0;
    unsigned long long size = 0;
    int consumed = 0;
    if (trailer.compare(0, prefix.size(), prefix) != 0 ||
        std::sscanf(trailer.c_str() + prefix.size(), "%8x size=%llu%n", &crc, &size, &consumed) != 2 ||
        prefix.size() + static_cast<size_t>(consumed) != trailer.size()) {
      return absl::DataLossError(absl::StrCat("state file ", path, " has a damaged trailer"));
    }
    const size_t pos = zip->eocd_offset + kEocdSize;
    if (size != pos) {
      return absl::DataLossError(absl::StrCat("state file ", path, " is truncated or padded: its trailer says ",
                                              size, " bytes of content, found ", pos));
    }
    content.assign(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(pos));
    content[pos - 2] = 0;  // restore the comment-less trailer the checksum was taken over
    content[pos - 1] = 0;
    const uint32_t actual = crc32_of(content.data(), content.size());
    if (actual != crc) {
      return absl::DataLossError(absl::StrFormat("state file %s is corrupted: checksum %08x, expected %08x", path,
                                                 actual, crc));
    }
  } else {
    // Python's torch.save (no trailer): every entry's CRC-32 was verified above.
    content = std::move(bytes);
  }
  try {
    return torch::jit::pickle_load(content);
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat("state file ", path, " passed its checksums but LibTorch cannot "
                                            "decode it: ", std::string(e.what()).substr(0, 200)));
  }
}

}  // namespace dtrain::checkpoint
