// dcp.h's read half: DcpReader. The save half is dcp.cc.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/dcp.h"
#include "checkpoint/internal/dcp_files.h"
#include "checkpoint/torch_file_reader.h"

namespace dtrain::checkpoint {

using dcp_internal::kMetadataFile;
using dcp_internal::os_error;

absl::StatusOr<DcpReader> DcpReader::open(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kMetadataFile);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(
          absl::StrCat("DCP checkpoint ", dir,
                       " has no .metadata: it is not a checkpoint, or its save did not "
                       "finish (load the previous one)"));
    }
    return os_error("cannot open", path);
  }
  std::string bytes;
  char buf[1 << 16];
  for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      absl::Status s = os_error("cannot read", path);
      ::close(fd);
      return s;
    }
    bytes.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  const std::string name = absl::StrCat("DCP checkpoint ", dir);
  absl::StatusOr<DcpMetadata> md = read_dcp_metadata(bytes, name);
  if (!md.ok()) return md.status();
  std::map<std::string, int64_t> sizes;
  auto note = [&](const DcpStorage& s) {
    if (sizes.count(s.relative_path) != 0) return;
    struct stat st {};
    if (::stat((dir + "/" + s.relative_path).c_str(), &st) == 0 && S_ISREG(st.st_mode))
      sizes[s.relative_path] = static_cast<int64_t>(st.st_size);
  };
  for (const auto& kv : md->tensors)
    for (const DcpChunk& c : kv.second.chunks) note(c.storage);
  for (const auto& kv : md->objects) note(kv.second);
  if (absl::Status s = check_dcp_files(*md, sizes, name); !s.ok()) return s;
  DcpReader r;
  r.dir_ = dir;
  r.metadata_ = std::make_shared<const DcpMetadata>(std::move(*md));
  return r;
}

absl::StatusOr<c10::IValue> DcpReader::read_item(const std::string& key,
                                                 const DcpStorage& s) const {
  const std::string path = absl::StrCat(dir_, "/", s.relative_path);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return os_error("cannot open", path);
  std::shared_ptr<char> buf(new (std::nothrow) char[static_cast<size_t>(s.length)],
                            std::default_delete<char[]>());
  if (buf == nullptr && s.length > 0) {
    ::close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("no memory for '", key, "' (", s.length, " bytes)"));
  }
  int64_t done = 0;
  while (done < s.length) {
    const ssize_t n =
        ::pread(fd, buf.get() + done, static_cast<size_t>(s.length - done), s.offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status st =
          n < 0 ? os_error("cannot read", path)
                : absl::DataLossError(absl::StrCat(path, " is shorter than its metadata says"));
      ::close(fd);
      return st;
    }
    done += n;
  }
  ::close(fd);
  *bytes_read_ += s.length;
  TorchFileReadOptions o;
  o.owner = buf;
  absl::StatusOr<c10::IValue> v = read_torch_file(
      std::string_view(buf.get(), static_cast<size_t>(s.length)),
      absl::StrCat("DCP checkpoint ", dir_, ": '", key, "' in ", s.relative_path), o);
  // The metadata says a torch.save of the item is there: anything else is damage.
  if (v.status().code() == absl::StatusCode::kInvalidArgument)
    return absl::DataLossError(v.status().message());
  return v;
}

absl::StatusOr<c10::IValue> DcpReader::value(const std::string& key) const {
  auto it = metadata_->objects.find(key);
  if (it == metadata_->objects.end()) {
    return absl::NotFoundError(
        absl::StrCat("DCP checkpoint ", dir_, " has no value '", key, "'",
                     metadata_->tensors.count(key) ? " (it is a tensor)" : ""));
  }
  return read_item(key, it->second);
}

absl::StatusOr<at::Tensor> DcpReader::tensor(const std::string& key,
                                             const std::vector<int64_t>& offsets_in,
                                             const std::vector<int64_t>& sizes_in,
                                             c10::Device device) const {
  auto it = metadata_->tensors.find(key);
  if (it == metadata_->tensors.end()) {
    return absl::NotFoundError(
        absl::StrCat("DCP checkpoint ", dir_, " has no tensor '", key, "'",
                     metadata_->objects.count(key) ? " (it is a value)" : ""));
  }
  const DcpTensor& t = it->second;
  const size_t rank = t.size.size();
  std::vector<int64_t> offsets =
      offsets_in.empty() && sizes_in.empty() ? std::vector<int64_t>(rank, 0) : offsets_in;
  std::vector<int64_t> sizes = offsets_in.empty() && sizes_in.empty() ? t.size : sizes_in;
  bool inside = offsets.size() == rank && sizes.size() == rank;
  for (size_t d = 0; inside && d < rank; ++d) {
    inside = offsets[d] >= 0 && sizes[d] >= 0 && offsets[d] <= t.size[d] &&
             sizes[d] <= t.size[d] - offsets[d];
  }
  if (!inside) {
    return absl::InvalidArgumentError(
        absl::StrCat("DcpReader::tensor('", key, "'): the box at [", absl::StrJoin(offsets, ", "),
                     "] of size [", absl::StrJoin(sizes, ", "),
                     "] is not inside the tensor of size [", absl::StrJoin(t.size, ", "), "]"));
  }
  at::Tensor out = at::empty(sizes, at::TensorOptions().dtype(t.dtype).device(device));
  for (const DcpChunk& c : t.chunks) {
    std::vector<int64_t> lo(rank), len(rank);
    bool overlaps = true;
    for (size_t d = 0; d < rank && overlaps; ++d) {
      lo[d] = std::max(offsets[d], c.offsets[d]);
      const int64_t hi = std::min(offsets[d] + sizes[d], c.offsets[d] + c.sizes[d]);
      len[d] = hi - lo[d];
      overlaps = len[d] > 0;
    }
    if (!overlaps || box_numel(c.sizes) == 0) continue;
    absl::StatusOr<c10::IValue> item = read_item(key, c.storage);
    if (!item.ok()) return item.status();
    if (!item->isTensor() || item->toTensor().sizes().vec() != c.sizes ||
        item->toTensor().scalar_type() != t.dtype) {
      return absl::DataLossError(
          absl::StrCat("DCP checkpoint ", dir_, ": '", key, "' in ", c.storage.relative_path,
                       " is not the chunk its metadata describes (a ", c10::toString(t.dtype),
                       " tensor of size [", absl::StrJoin(c.sizes, ", "), "])"));
    }
    at::Tensor src = item->toTensor();
    at::Tensor dst = out;
    for (size_t d = 0; d < rank; ++d) {
      src = src.narrow(static_cast<int64_t>(d), lo[d] - c.offsets[d], len[d]);
      dst = dst.narrow(static_cast<int64_t>(d), lo[d] - offsets[d], len[d]);
    }
    dst.copy_(src);
  }
  return out;
}

}  // namespace dtrain::checkpoint
