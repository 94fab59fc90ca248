// Sharded checkpoints: every rank writes its own shard in parallel, then rank 0 writes one
// metadata file -- the commit marker -- naming the shards and which element ranges of which
// parameters each holds. Loading works at any world size and partition: a rank asks for the
// (parameter, element range) pieces it owns now and reads only the shards that overlap them,
// re-slicing shards saved with element-granular partitions.
//
//   ShardedState mine;                                      // this rank's part of the state
//   mine.params[7] = {{1024, 512}, {0, 1024 * 512}, entries};   // whole parameter 7
//   mine.params[9] = {{4096}, {0, 2048}, entries};          // first half of parameter 9 (flat)
//   absl::Status s = save_sharded(group, "/ckpt/step1000", mine, "flat");   // collective
//   ...
//   // Later, at another world size: the pieces this rank owns under its new partition.
//   absl::StatusOr<ShardedState> back = load_sharded("/ckpt/step1000", {{7, {0, 1024 * 512}}, {9, {1000, 4096}}});
#ifndef DTRAIN_CHECKPOINT_SHARDED_H_
#define DTRAIN_CHECKPOINT_SHARDED_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/state_file.h"
#include "comm/process_group.h"
#include "partition/flat_partition.h"

namespace dtrain::checkpoint {

struct ShardedState {
  struct Param {
    std::vector<int64_t> shape;  // the full parameter's shape
    partition::Range range;      // the elements held here; [0, numel) = the whole parameter
    // PyTorch's per-parameter state entries. Tensors hold exactly `range`: full-shaped when it is
    // the whole parameter, 1-D of range.size() elements otherwise. Non-tensors (step counters,
    // None) are the parameter's own.
    c10::impl::GenericDict entries{c10::StringType::get(), c10::AnyType::get()};
  };
  std::map<int64_t, Param> params;  // by global parameter index
  // Saved from rank 0 and returned by load: PyTorch param_groups (global indices) and any user
  // metadata (step, epoch, ...). None when absent.
  c10::IValue param_groups;
  c10::IValue extra;
};

struct ShardedInfo {
  int world_size = 0;
  std::string strategy;
  std::string save_id;
  std::map<int64_t, std::vector<int64_t>> shapes;  // every saved parameter's full shape
  c10::IValue param_groups;
  c10::IValue extra;
};

// Collective over `group`. Writes dir/shard-<id>-<rank>.pt on every rank, then (only if every
// rank succeeded) dir/metadata.pt on rank 0, then removes shards of earlier saves in `dir`. The
// directory must exist. `strategy` is recorded for the reader ("sorted_greedy", "flat", ...).
// Tensors may live on a GPU (the files record them as on the CPU: checkpoint/torch_file_writer.h);
// the only collectives are object collectives, which run on the group's device.
// Errors: the first failing rank's I/O error, on every rank; InvalidArgument for a range that
// does not fit its shape or tensors that do not match their range; a collective's failure (a rank
// that stopped or lost its link: Unavailable, DeadlineExceeded) as "save_sharded(<dir>) on rank
// <R>, <the step it was in>: <the transport's error>".
absl::Status save_sharded(const comm::Group& group, const std::string& dir,
                          const ShardedState& mine, const std::string& strategy);

// The commit marker's contents. FailedPrecondition "incomplete checkpoint" when the directory
// has shards but no metadata (a save that did not finish), NotFound when it has neither.
absl::StatusOr<ShardedInfo> read_sharded_info(const std::string& dir);

// The requested pieces (parameter index -> element range), assembled from the overlapping
// shards only, on the CPU, then every tensor moved to options.map_location (default: the CPU).
// Errors: those of read_sharded_info; InvalidArgument for an unknown parameter or a range
// outside it, or a map_location this process cannot use; DataLoss when a shard is corrupt, is
// another rank's copied into its place (each records its rank and ranges), or the shards do not
// cover a range; ResourceExhausted when map_location runs out of memory.
absl::StatusOr<ShardedState> load_sharded(const std::string& dir,
                                          const std::map<int64_t, partition::Range>& wanted,
                                          const LoadOptions& options = {});

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_SHARDED_H_
