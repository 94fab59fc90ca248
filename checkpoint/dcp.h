// torch.distributed.checkpoint (DCP) checkpoints, written and read by dtrain: the directory
// layout PyTorch's dcp.save writes and dcp.load reads (2.6-2.15), so a LibTorch job and a Python
// job hand sharded state to each other at any world size, with no gather onto one rank.
//
//   // Save (collective): each rank passes what it holds -- whole tensors written by one rank,
//   // chunks of sharded ones (ZeRO's shards), values (step counts, learning rates) by one rank.
//   std::vector<DcpWriteItem> mine;
//   mine.push_back(DcpWriteItem::whole("model.0.weight", weight));            // rank 0 only
//   mine.push_back(DcpWriteItem::chunk("optim.state.0.weight.exp_avg", {8, 4}, {4, 0}, rows4to7));
//   mine.push_back(DcpWriteItem::object("optim.param_groups.0.lr", 1e-3));   // rank 0 only
//   absl::Status s = save_dcp(group, "/ckpt/step100", mine);
//   // Python: dcp.load(state_dict, checkpoint_id="/ckpt/step100") at any world size.
//
//   // Load (per rank, no collective): only the byte ranges of the chunks that overlap.
//   absl::StatusOr<DcpReader> r = DcpReader::open("/ckpt/step100");
//   absl::StatusOr<at::Tensor> rows = r->tensor("optim.state.0.weight.exp_avg", {2, 0}, {4, 4});
//   absl::StatusOr<c10::IValue> lr = r->value("optim.param_groups.0.lr");
//
// Files: dir/__<rank>_0.distcp holds that rank's items back to back, each a torch.save of one
// tensor chunk (its own compact storage) or one value; dir/.metadata (checkpoint/dcp_metadata.h)
// is written by rank 0 after every rank wrote its file (.metadata.tmp, fsync, rename, fsync of
// the directory): a checkpoint without .metadata is incomplete and never read. Each save goes to
// its own directory (PyTorch's checkpoint_id): save_dcp refuses a directory that holds one unless
// DcpSaveOptions::overwrite.
#ifndef DTRAIN_CHECKPOINT_DCP_H_
#define DTRAIN_CHECKPOINT_DCP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/dcp_metadata.h"
#include "comm/process_group.h"

namespace dtrain::checkpoint {

// One thing a rank writes: a tensor chunk, or a value (tensor undefined).
struct DcpWriteItem {
  std::string key;  // the flattened key ("optim.state.0.weight.exp_avg")
  // The key's path in the nested state dict (planner_data: what PyTorch's dcp_to_torch_save and
  // dcp.load without a state dict rebuild); empty: the key split at '.'.
  DcpPath path;
  at::Tensor tensor;                 // the chunk's data (CPU or GPU; copied to the CPU to write)
  std::vector<int64_t> global_size;  // the whole tensor's shape
  std::vector<int64_t> offsets;      // where the chunk starts in it
  c10::IValue value;                 // a value: anything write_torch_file writes

  static DcpWriteItem whole(std::string key, at::Tensor tensor, DcpPath path = {});
  static DcpWriteItem chunk(std::string key, std::vector<int64_t> global_size,
                            std::vector<int64_t> offsets, at::Tensor data, DcpPath path = {});
  static DcpWriteItem object(std::string key, c10::IValue value, DcpPath path = {});
};

struct DcpSaveOptions {
  // Write into a directory that already holds a DCP checkpoint (its .metadata is replaced last,
  // but its data files are rewritten first: a crash in between loses both). Default false:
  // FailedPrecondition, one directory per checkpoint.
  bool overwrite = false;
};

// Collective over `group`: every rank writes its items to dir/__<rank>_0.distcp (a rank with
// none writes no file), then rank 0 checks that the chunks of every tensor tile it exactly --
// the same dtype and shape from every rank, no key written twice -- and commits .metadata. The
// directory must exist. Errors, the same on every rank: InvalidArgument for items that cannot be
// written (a chunk outside its tensor, a key both a tensor and a value, ranks disagreeing on a
// tensor's shape or dtype, chunks that overlap or leave holes: the message names the key and the
// ranks), FailedPrecondition for a directory holding a checkpoint, the first failing rank's I/O
// error, a collective's failure ("save_dcp(<dir>) on rank R, <step>: ...").
absl::Status save_dcp(const comm::Group& group, const std::string& dir,
                      const std::vector<DcpWriteItem>& mine, const DcpSaveOptions& options = {});

// Reads a DCP checkpoint, whoever wrote it. Opening reads and checks .metadata and every file's
// size; items are read on request, each with one pread of its own bytes.
class DcpReader {
 public:
  // Errors: NotFound (no .metadata: no checkpoint, or an incomplete save), the errors of
  // read_dcp_metadata and check_dcp_files, I/O errors naming the path.
  static absl::StatusOr<DcpReader> open(const std::string& dir);

  const DcpMetadata& metadata() const { return *metadata_; }
  const std::string& dir() const { return dir_; }

  // The box [offsets, offsets + sizes) of tensor `key` (both empty: the whole tensor), on
  // `device`, assembled from the chunks that overlap it: peak extra memory one chunk's bytes.
  // Errors: NotFound (no such tensor key), InvalidArgument (a box outside the tensor), DataLoss
  // (an item that is not the tensor chunk the metadata says: names the key and file), I/O.
  absl::StatusOr<at::Tensor> tensor(const std::string& key,
                                    const std::vector<int64_t>& offsets = {},
                                    const std::vector<int64_t>& sizes = {},
                                    c10::Device device = c10::Device(c10::kCPU)) const;
  // A bytes item's value (torch.save of it). Errors: NotFound, DataLoss, I/O.
  absl::StatusOr<c10::IValue> value(const std::string& key) const;

  // Bytes read from the data files so far (for tests and benchmarks).
  int64_t bytes_read() const { return *bytes_read_; }

 private:
  DcpReader() = default;
  absl::StatusOr<c10::IValue> read_item(const std::string& key, const DcpStorage& s) const;

  std::string dir_;
  std::shared_ptr<const DcpMetadata> metadata_;
  std::shared_ptr<int64_t> bytes_read_ = std::make_shared<int64_t>(0);
};

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_DCP_H_
