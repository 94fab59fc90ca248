// Consolidation of sharded optimizer state: a collective that gathers every rank's partial state
// dict (PyTorch's optimizer format, state keyed by *global* parameter index) onto one rank and
// merges it. Tensors travel as tensors -- point to point, in bounded chunks, as bytes -- never
// pickled; only the small description of which entries exist is pickled. The state may live on
// any device (a GPU's optimizer state included): chunks travel on the group's device
// (comm::Group::device(): the GPU for NCCL, which sends only GPU tensors; the CPU for Gloo), a
// chunk copied there first where the state lives elsewhere. On a CPU group the target receives
// straight into its final CPU tensors; on a GPU group through device buffers of at most 64 MiB,
// each copied into its CPU tensor. Ranks other than the target allocate nothing beyond the
// description and, where their state is not on the group's device, one chunk there.
//
//   // On every rank of `group`: this rank's part, e.g. a ZeRO shard's optimizer state.
//   absl::StatusOr<c10::IValue> full =
//       dtrain::checkpoint::consolidate_state_dict(group, local_state_dict, /*to=*/0);
//   if (!full.ok()) return full.status();
//   if (group.rank() == 0) save(*full);          // none elsewhere: *full is None there
#ifndef DTRAIN_CHECKPOINT_CONSOLIDATION_H_
#define DTRAIN_CHECKPOINT_CONSOLIDATION_H_

#include <cstdint>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "comm/process_group.h"

namespace dtrain::checkpoint {

struct ConsolidateOptions {
  // Largest single message, in bytes (default 16 MiB): bounds the transport's buffers.
  int64_t chunk_bytes = int64_t{16} << 20;
};

// Collective over `group`: every rank calls it with the same `to`.
// REQUIRES local_state_dict in PyTorch's optimizer format (checkpoint/optimizer_state_dict.h):
// state {global index: {name: tensor | int | float | None}}, param groups [{..., params: [global
// indices]}]. State entries must be disjoint across ranks (each parameter's state on one rank; a
// duplicate index is an error naming both ranks). Param groups are merged group by group: the
// options come from rank `to`, "params" is the sorted union of all ranks' lists (every rank must
// pass the same number of groups).
// Returns the merged state dict on `to` (state sorted by index, every tensor on the CPU, as
// PyTorch's ZeroRedundancyOptimizer.consolidate_state_dict leaves it; the target's own CPU tensors
// may be returned as they are) and None elsewhere.
// Errors: InvalidArgument (bad `to`, malformed dict, group count mismatch, duplicate entries),
// DeadlineExceeded/Unavailable from the transport (e.g. a rank that never calls).
absl::StatusOr<c10::IValue> consolidate_state_dict(const comm::Group& group,
                                                   const c10::IValue& local_state_dict, int to,
                                                   const ConsolidateOptions& options = {});

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_CONSOLIDATION_H_
