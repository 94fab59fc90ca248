#include "checkpoint/dcp.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/internal/dcp_files.h"
#include "checkpoint/torch_file_writer.h"
#include "comm/agreement.h"
#include "comm/object_collectives.h"

namespace dtrain::checkpoint {
namespace {

using dcp_internal::kMetadataFile;
using dcp_internal::os_error;

// A file written piece by piece, then fsynced and closed.
class OutFile {
 public:
  absl::Status open(const std::string& path) {
    path_ = path;
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    return fd_ < 0 ? os_error("cannot create", path) : absl::OkStatus();
  }
  absl::Status append(std::string_view bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n =
          ::write(fd_, bytes.data() + done, std::min<size_t>(bytes.size() - done, size_t{1} << 26));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return os_error("cannot write", path_);
      done += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }
  absl::Status finish() {
    if (::fsync(fd_) != 0) return os_error("cannot fsync", path_);
    const int fd = fd_;
    fd_ = -1;
    return ::close(fd) == 0 ? absl::OkStatus() : os_error("cannot close", path_);
  }
  ~OutFile() {
    if (fd_ >= 0) ::close(fd_);
  }

 private:
  std::string path_;
  int fd_ = -1;
};

// Writes `bytes` to `path` (created or truncated) and fsyncs it.
absl::Status write_file(const std::string& path, std::string_view bytes) {
  OutFile f;
  if (absl::Status s = f.open(path); !s.ok()) return s;
  if (absl::Status s = f.append(bytes); !s.ok()) return s;
  return f.finish();
}

absl::Status sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return os_error("cannot open directory", dir);
  const int rc = ::fsync(fd);
  ::close(fd);
  return rc == 0 ? absl::OkStatus() : os_error("cannot fsync directory", dir);
}

c10::IValue path_ivalue(const DcpPath& path) {
  c10::impl::GenericList out(c10::AnyType::get());
  for (const auto& part : path) {
    if (const std::string* s = std::get_if<std::string>(&part)) {
      out.push_back(*s);
    } else {
      out.push_back(std::get<int64_t>(part));
    }
  }
  return out;
}

DcpPath path_of(const c10::IValue& v) {
  DcpPath out;
  for (const c10::IValue& part : v.toListRef()) {
    if (part.isString()) {
      out.emplace_back(part.toStringRef());
    } else {
      out.emplace_back(part.toInt());
    }
  }
  return out;
}

std::vector<int64_t> ints(const c10::IValue& v) {
  std::vector<int64_t> out;
  for (const c10::IValue& e : v.toListRef()) out.push_back(e.toInt());
  return out;
}

// A chunk as a compact CPU tensor of its own storage (what the file holds).
at::Tensor compact(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  if (c.storage_offset() != 0 ||
      static_cast<int64_t>(c.storage().nbytes()) != c.numel() * c.element_size()) {
    c = c.clone();
  }
  return c;
}

// What a rank wrote: one tuple per item (key, is_tensor, dtype, requires_grad, global_size,
// offsets, sizes, offset, length, path), plus its error.
struct Report {
  std::string error;
  std::string file;
  c10::impl::GenericList items{c10::AnyType::get()};
  c10::IValue encode() const { return c10::ivalue::Tuple::create({error, file, items}); }
};

absl::Status check_item(const DcpWriteItem& item) {
  const std::string where = absl::StrCat("save_dcp: item '", item.key, "'");
  if (item.key.empty()) return absl::InvalidArgumentError("save_dcp: an item has an empty key");
  if (!item.tensor.defined()) return absl::OkStatus();
  const auto sizes = item.tensor.sizes();
  if (item.global_size.size() != sizes.size() || item.offsets.size() != sizes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": its chunk has ", sizes.size(), " dimensions, its global size ",
                     item.global_size.size(), " and its offsets ", item.offsets.size()));
  }
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (item.offsets[d] < 0 || item.global_size[d] < 0 || item.offsets[d] > item.global_size[d] ||
        sizes[d] > item.global_size[d] - item.offsets[d]) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the chunk at [", absl::StrJoin(item.offsets, ", "), "] of size [",
                       absl::StrJoin(sizes, ", "), "] lies outside the tensor of size [",
                       absl::StrJoin(item.global_size, ", "), "]"));
    }
  }
  return absl::OkStatus();
}

// Writes this rank's file; fills `report`.
absl::Status write_mine(const std::string& dir, int rank, const std::vector<DcpWriteItem>& mine,
                        Report* report) {
  if (mine.empty()) return absl::OkStatus();
  report->file = absl::StrCat("__", rank, "_0.distcp");
  OutFile out;
  if (absl::Status s = out.open(absl::StrCat(dir, "/", report->file)); !s.ok()) return s;
  int64_t offset = 0;
  for (const DcpWriteItem& item : mine) {
    if (absl::Status s = check_item(item); !s.ok()) return s;
    const bool is_tensor = item.tensor.defined();
    absl::StatusOr<std::string> one =
        write_torch_file(is_tensor ? c10::IValue(compact(item.tensor)) : item.value);
    if (!one.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "save_dcp: item '", item.key, "' cannot be written: ", one.status().message()));
    }
    std::vector<int64_t> sizes;
    if (is_tensor) sizes = item.tensor.sizes().vec();
    report->items.push_back(c10::ivalue::Tuple::create(
        {item.key, is_tensor,
         static_cast<int64_t>(is_tensor ? item.tensor.scalar_type() : at::kFloat),
         is_tensor && item.tensor.requires_grad(), c10::List<int64_t>(item.global_size),
         c10::List<int64_t>(item.offsets), c10::List<int64_t>(sizes), offset,
         static_cast<int64_t>(one->size()), path_ivalue(item.path)}));
    if (absl::Status s = out.append(*one); !s.ok()) return s;
    offset += static_cast<int64_t>(one->size());
  }
  return out.finish();
}

// Rank 0: every rank's items into one metadata, checked.
absl::StatusOr<DcpMetadata> merge_reports(const std::vector<c10::IValue>& reports,
                                          const std::string& save_id) {
  DcpMetadata md;
  md.save_id = save_id;
  md.version = "1.0.0";
  std::map<std::string, int> writer;  // key -> the rank that first wrote it
  for (size_t r = 0; r < reports.size(); ++r) {
    const auto& rep = reports[r].toTupleRef().elements();
    const std::string file = rep[1].toStringRef();
    for (const c10::IValue& v : rep[2].toListRef()) {
      const auto& e = v.toTupleRef().elements();
      const std::string key = e[0].toStringRef();
      const bool is_tensor = e[1].toBool();
      const DcpStorage storage{file, e[7].toInt(), e[8].toInt()};
      auto [it, first] = writer.emplace(key, static_cast<int>(r));
      const bool was_tensor = md.tensors.count(key) != 0;
      if (!first && (!is_tensor || !was_tensor)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "save_dcp: '", key, "' is written by ranks ", it->second, " and ", r,
            is_tensor || was_tensor ? " as a tensor and as a value" : " as a value twice",
            "; a value (and a whole tensor) is written by one rank only, as DCP's coordinator "
            "does"));
      }
      if (!e[9].toListRef().empty()) md.paths[key] = path_of(e[9]);
      if (!is_tensor) {
        md.objects[key] = storage;
        continue;
      }
      DcpTensor& t = md.tensors[key];
      const auto dtype = static_cast<at::ScalarType>(e[2].toInt());
      const std::vector<int64_t> global = ints(e[4]);
      if (first) {
        t.dtype = dtype;
        t.requires_grad = e[3].toBool();
        t.size = global;
      } else if (t.dtype != dtype || t.size != global) {
        return absl::InvalidArgumentError(
            absl::StrCat("save_dcp: ranks ", it->second, " and ", r, " write chunks of '", key,
                         "' with different dtypes or shapes ([", absl::StrJoin(t.size, ", "),
                         "] vs [", absl::StrJoin(global, ", "), "])"));
      }
      DcpChunk chunk{ints(e[5]), ints(e[6]), storage};
      for (const DcpChunk& c : t.chunks) {
        if (c.offsets == chunk.offsets && box_numel(chunk.sizes) > 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("save_dcp: '", key, "' has two chunks at [",
                           absl::StrJoin(chunk.offsets, ", "), "] (rank ", r,
                           " and an earlier rank write the same part; a whole tensor is written "
                           "by one rank only, as DCP's coordinator does)"));
        }
      }
      t.chunks.push_back(std::move(chunk));
    }
  }
  // The same checks any reader makes: chunks tiling each tensor exactly.
  const std::string bytes = write_dcp_metadata(md);
  absl::StatusOr<DcpMetadata> back = read_dcp_metadata(bytes, "save_dcp's metadata");
  if (!back.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "save_dcp: the ranks' chunks do not make a checkpoint: ", back.status().message()));
  }
  return md;
}

}  // namespace

DcpWriteItem DcpWriteItem::whole(std::string key, at::Tensor tensor, DcpPath path) {
  DcpWriteItem item;
  item.key = std::move(key);
  item.path = std::move(path);
  item.global_size = tensor.sizes().vec();
  item.offsets.assign(item.global_size.size(), 0);
  item.tensor = std::move(tensor);
  return item;
}

DcpWriteItem DcpWriteItem::chunk(std::string key, std::vector<int64_t> global_size,
                                 std::vector<int64_t> offsets, at::Tensor data, DcpPath path) {
  DcpWriteItem item;
  item.key = std::move(key);
  item.path = std::move(path);
  item.global_size = std::move(global_size);
  item.offsets = std::move(offsets);
  item.tensor = std::move(data);
  return item;
}

DcpWriteItem DcpWriteItem::object(std::string key, c10::IValue value, DcpPath path) {
  DcpWriteItem item;
  item.key = std::move(key);
  item.path = std::move(path);
  item.value = std::move(value);
  return item;
}

absl::Status save_dcp(const comm::Group& group, const std::string& dir,
                      const std::vector<DcpWriteItem>& mine, const DcpSaveOptions& options) {
  if (!group.is_member())
    return absl::FailedPreconditionError("save_dcp: this rank is not in the group");
  auto on_rank = [&](const absl::Status& s, const char* step) {
    return absl::Status(s.code(), absl::StrCat("save_dcp(", dir, ") on rank ", group.rank(), ", ",
                                               step, ": ", s.message()));
  };
  c10::IValue id{std::string()};
  if (group.rank() == 0) {
    std::random_device rd;
    id = absl::StrFormat("%08x-%08x", rd(), rd());
  }
  if (absl::Status s = comm::broadcast_object(group, id, 0); !s.ok())
    return on_rank(s, "receiving the save's id from rank 0");

  Report report;
  absl::Status written;
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    written = absl::NotFoundError(
        absl::StrCat("save_dcp: ", dir, " is not a directory; create it first"));
  } else if (!options.overwrite && ::access((dir + "/" + kMetadataFile).c_str(), F_OK) == 0) {
    written = absl::FailedPreconditionError(
        absl::StrCat("save_dcp: ", dir,
                     " already holds a DCP checkpoint; save each checkpoint to its own "
                     "directory (or set DcpSaveOptions::overwrite)"));
  } else {
    written = write_mine(dir, group.rank(), mine, &report);
  }
  if (!written.ok()) report.error = std::string(written.message());
  absl::StatusOr<std::vector<c10::IValue>> reports = comm::gather_object(group, report.encode(), 0);
  if (!reports.ok()) {
    return on_rank(reports.status(), group.rank() == 0 ? "gathering every rank's items"
                                                       : "sending its items to rank 0");
  }
  absl::Status verdict;
  if (group.rank() == 0) {
    for (int r = 0; r < group.size() && verdict.ok(); ++r) {
      const std::string error = (*reports)[r].toTupleRef().elements()[0].toStringRef();
      if (!error.empty()) {
        verdict = r == 0
                      ? written
                      : absl::UnavailableError(absl::StrCat("save_dcp(", dir, ") failed on rank ",
                                                            r, ", nothing committed: ", error));
      }
    }
    if (verdict.ok()) {
      absl::StatusOr<DcpMetadata> md = merge_reports(*reports, id.toStringRef());
      verdict = md.status();
      if (md.ok()) {
        const std::string tmp = absl::StrCat(dir, "/", kMetadataFile, ".tmp");
        verdict = write_file(tmp, write_dcp_metadata(*md));
        if (verdict.ok() && ::rename(tmp.c_str(), (dir + "/" + kMetadataFile).c_str()) != 0)
          verdict = os_error("cannot rename", tmp);
        if (verdict.ok()) verdict = sync_dir(dir);
      }
    }
  }
  absl::Status shared = comm::share_verdict(group, verdict, 0);
  if (!shared.ok() && !absl::StartsWith(shared.message(), "save_dcp")) {
    return on_rank(shared,
                   group.rank() == 0 ? "sending the verdict" : "receiving rank 0's verdict");
  }
  return shared;
}

}  // namespace dtrain::checkpoint
