// ZeroRedundancyOptimizer's state conversions, between the four forms its optimizer state takes:
//   local    the local optimizer's state dict (PyTorch format, local indices 0..n-1 over this
//            rank's entries, groups in order);
//   global   PyTorch's format of the unsharded optimizer (state keyed by global parameter index,
//            every group listing all its parameters);
//   pieces   what a rank contributes to consolidation (state keyed by global index or by flat
//            offset, see the layouts);
//   sharded  checkpoint::ShardedState, a rank's (parameter, element range) pieces.
// A rank's entries (LocalEntry) say which parameter, and which elements of it, local index k is.
// Every form is checkpoint/optimizer_state_dict.h's model (or its IValue). Internal to optim/
// (ZeroRedundancyOptimizer and its layouts).
//
//   const std::vector<LocalEntry>& entries = layout.entries();
//   checkpoint::OptimizerStateDict local{local_state_from_global(global.state, entries, layout.params()),
//                                        local_param_groups(global.param_groups, entries, counts)};
//   load_optimizer_state_dict(local_optimizer, checkpoint::to_ivalue(local));
#ifndef DTRAIN_OPTIM_ZERO_INTERNAL_STATE_H_
#define DTRAIN_OPTIM_ZERO_INTERNAL_STATE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/optimizer_state_dict.h"
#include "checkpoint/sharded.h"

namespace dtrain::optim::internal {

// Local index k of the local optimizer: (a piece of) a parameter.
struct LocalEntry {
  int64_t param = 0;       // global parameter index
  partition::Range range;  // elements of the flattened parameter it covers
  size_t group = 0;        // parameter group
  // The local tensor is a 1-D slice of the parameter (kFlat), not the parameter itself: its
  // state tensors are 1-D slices too, even when the range is the whole parameter.
  bool slice = false;
};

// State by index (local, global or flat offset, depending on the form).
using IndexedState = std::map<int64_t, checkpoint::StateEntry>;

// Per group, all its parameters by global index (groups concatenated), as the unsharded
// optimizer lists them; `group_counts[g]` is group g's parameter count.
std::vector<std::vector<int64_t>> all_group_params(const std::vector<size_t>& group_counts);
// A local state dict re-keyed for consolidation: entry k's state under keys[k], group g's
// parameters group_params[g]. Errors (c10::Error): a dict not in PyTorch's format.
c10::IValue rekeyed_state_dict(const c10::IValue& local_state_dict,
                               const std::vector<int64_t>& keys,
                               const std::vector<std::vector<int64_t>>& group_params);
// Consolidated pieces keyed by flat offset -> PyTorch's global format: each parameter's pieces
// concatenated in offset order, shaped like the parameter. flat_offsets[i]: where parameter i
// starts in the flat buffer.
c10::IValue assemble_pieces(const c10::IValue& merged, const std::vector<int64_t>& flat_offsets,
                            const std::vector<at::Tensor>& params);

// Global -> local: the global state's entries for this rank's entries (slices cut out and
// checked against the parameter's shape), keyed by local index. Parameters without state are
// left out.
IndexedState local_state_from_global(const IndexedState& state,
                                     const std::vector<LocalEntry>& entries,
                                     const std::vector<at::Tensor>& params);
// Global param groups -> the local optimizer's: same options, parameters renumbered to local
// indices. Errors (c10::Error): group count or a group's parameter count differs from
// `group_counts`.
std::vector<checkpoint::ParamGroup> local_param_groups(
    const std::vector<checkpoint::ParamGroup>& groups, const std::vector<LocalEntry>& entries,
    const std::vector<size_t>& group_counts);

// Checks one state entry of a loaded global dict: (param group, entry, the parameter, its index
// in the file, the group's options in the file) -> OK or InvalidArgument naming the index.
using EntryCheck = std::function<absl::Status(size_t group, const checkpoint::StateEntry& entry,
                                              const at::Tensor& param, int64_t file_index,
                                              const c10::impl::GenericDict& group_options)>;
// A global dict, checked, keyed by this optimizer's parameter index (groups concatenated).
struct CheckedGlobal {
  IndexedState state;
  std::vector<checkpoint::ParamGroup> groups;  // the file's options; params as in the file
  std::vector<int64_t> file_index;             // parameter i's index in the file
};
// The whole global dict against every parameter (not only this rank's: every rank refuses a bad
// dict with the same message, whichever rank owns the bad part): group and parameter counts,
// "params" holding each of 0..n-1 once (a permutation maps the file's index to this position, as
// PyTorch's load_state_dict zips the groups' params), finite option numbers, and each entry by
// `check`, in parameter order. InvalidArgument "<what>: ..." naming the group or file index.
absl::StatusOr<CheckedGlobal> checked_global_state(const checkpoint::OptimizerStateDict& sd,
                                                   const std::vector<at::Tensor>& params,
                                                   const std::vector<size_t>& group_counts,
                                                   const EntryCheck& check,
                                                   const std::string& what);

// The pieces this rank owns (global index -> element range), empty ranges left out.
std::map<int64_t, partition::Range> owned_ranges(const std::vector<LocalEntry>& entries);
// Local -> sharded: a whole parameter's state full-shaped, a slice's 1-D; global param groups.
checkpoint::ShardedState sharded_from_local(const c10::IValue& local_state_dict,
                                            const std::vector<LocalEntry>& entries,
                                            const std::vector<at::Tensor>& params,
                                            const std::vector<size_t>& group_counts);
// Sharded -> local state (keyed by local index). Errors (c10::Error): a piece whose range or
// shape is not the one `rank` owns, or whose tensors do not hold its range.
IndexedState local_state_from_sharded(const checkpoint::ShardedState& state,
                                      const std::vector<LocalEntry>& entries,
                                      const std::vector<at::Tensor>& params, int rank);
// A sharded checkpoint's metadata against this optimizer: every saved parameter exists here with
// the same shape, and the groups agree (their number, and each one's parameter count against
// `group_counts`). InvalidArgument naming the difference.
absl::Status check_sharded_info(const checkpoint::ShardedInfo& info, const std::string& dir,
                                const std::vector<at::Tensor>& params,
                                const std::vector<size_t>& group_counts);

}  // namespace dtrain::optim::internal

#endif  // DTRAIN_OPTIM_ZERO_INTERNAL_STATE_H_
