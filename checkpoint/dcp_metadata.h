// torch.distributed.checkpoint (DCP) metadata: the `.metadata` file of a DCP checkpoint directory
// as typed values, read with dtrain's own pickle reader (an allow-list of exactly DCP's classes:
// checkpoint/pickle_reader.h's PickleDialect::kDcpMetadata; PyTorch itself reads this file with
// an unrestricted pickle.load), checked completely, and written back byte for byte loadable by
// PyTorch's `dcp.load` (2.6 and later).
//
//   absl::StatusOr<DcpMetadata> md = read_dcp_metadata(bytes, "checkpoint /ckpt/step100");
//   if (!md.ok()) return md.status();              // names the checkpoint and what is wrong
//   for (const auto& [key, t] : md->tensors)        // "optim.state.0.weight.exp_avg" -> chunks
//     for (const DcpChunk& c : t.chunks) use(c.offsets, c.sizes, c.storage.relative_path);
//   absl::Status s = check_dcp_files(*md, {{"__0_0.distcp", 40960}}, "checkpoint /ckpt/step100");
//
// The format (PyTorch 2.6-2.15, torch/distributed/checkpoint/metadata.py and filesystem.py; 2.15
// adds the saved tensor's strides to TensorProperties, read and not needed):
// Metadata(state_dict_metadata={key: TensorStorageMetadata(properties, size, chunks) |
// BytesStorageMetadata()}, planner_data={key: path tuple}, storage_data={MetadataIndex(key,
// chunk offsets | None): _StorageInfo(relative_path, offset, length)}, storage_meta, version).
// Keys are the state dict's keys flattened with '.' ("model.0.weight", "optim.param_groups.0.lr").
// Each tensor chunk and each bytes item is one torch.save of it, `length` bytes at `offset` in
// the file `relative_path` of the checkpoint directory.
#ifndef DTRAIN_CHECKPOINT_DCP_METADATA_H_
#define DTRAIN_CHECKPOINT_DCP_METADATA_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dtrain::checkpoint {

// Where one item's bytes are: a torch.save of it, `length` bytes at `offset` in `relative_path`.
struct DcpStorage {
  std::string relative_path;  // a plain file name inside the checkpoint directory
  int64_t offset = 0;
  int64_t length = 0;
};

// One box of a tensor: elements [offsets[d], offsets[d] + sizes[d]) in every dimension d.
struct DcpChunk {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  DcpStorage storage;
};

struct DcpTensor {
  at::ScalarType dtype = at::kFloat;
  bool requires_grad = false;
  std::vector<int64_t> size;     // the whole tensor's shape
  std::vector<DcpChunk> chunks;  // disjoint, covering the tensor exactly (checked)
};

using DcpPath = std::vector<std::variant<std::string, int64_t>>;

struct DcpMetadata {
  std::map<std::string, DcpTensor> tensors;   // by flattened key
  std::map<std::string, DcpStorage> objects;  // bytes items: a torch.save of a value
  // planner_data: each flattened key's path in the nested state dict -- ("model", "0.weight"),
  // ("optim", "param_groups", 0, "lr"): str for dict keys, int for list indices. Keys the file
  // gives no path for are absent.
  std::map<std::string, DcpPath> paths;
  std::string save_id;  // StorageMeta.save_id, "" when absent
  std::string version;  // "1.0.0" today; "" when absent (older writers)
};

// Reads and checks `.metadata`'s bytes: the pickle (the DCP dialect), every key of
// state_dict_metadata with its storage (no key without one, no storage without a key), dtypes
// among the 12 standard ones, layout torch.strided, sizes >= 0, each chunk inside its tensor, no
// two chunks overlapping, the chunks covering every element, offsets and lengths >= 0, relative
// paths plain file names (no '/', no "..", no NUL), no transform descriptors (compression and
// the other storage-writer extensions are refused by name). `name_for_errors` says which
// checkpoint ("DCP checkpoint /ckpt/step100"). Errors: DataLoss for damage and impossible content
// (the message names the key and what is wrong), InvalidArgument for well-formed content dtrain
// does not read (a global outside the allow-list, a transform, another layout).
// Thread safety: a pure function of its arguments.
absl::StatusOr<DcpMetadata> read_dcp_metadata(std::string_view bytes,
                                              const std::string& name_for_errors);

// Checks every item against the files' sizes (relative path -> bytes): a file that is missing,
// an item that runs past its file's end, two items that overlap. DataLoss naming the key.
absl::Status check_dcp_files(const DcpMetadata& metadata,
                             const std::map<std::string, int64_t>& file_sizes,
                             const std::string& name_for_errors);

// `.metadata`'s bytes for `metadata` as PyTorch's pickler writes it (protocol 2), which
// PyTorch's dcp.load (2.6 and later) reads, and read_dcp_metadata reads back equal. `paths` left
// empty are written as the key split at '.'; StorageMeta gets save_id and no checkpoint_id.
// The content is not checked (tests write damaged files with it): the caller keeps chunks an
// exact cover and paths plain. TORCH_CHECK: a dtype other than the 12 standard ones, a key that
// is both a tensor and bytes.
std::string write_dcp_metadata(const DcpMetadata& metadata);

// The number of elements of a box; 0 for an empty one.
int64_t box_numel(const std::vector<int64_t>& sizes);

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_DCP_METADATA_H_
