// Model and optimizer state in a DCP checkpoint (checkpoint/dcp.h) under the keys PyTorch's
// torch.distributed.checkpoint.state_dict.get_state_dict gives them, so that
// `dcp.load({"model": msd, "optim": osd}, ...)` + `set_state_dict` in Python, at any world size,
// reads what a dtrain job saved, and a dtrain job resumes from what Python saved:
//
//   model.<fqn>                         each parameter (and buffer) -- whole, from one rank
//   optim.state.<fqn>.<name>            each state tensor: whole, or the chunks of a ZeRO shard
//                                       ("step" always a float32 0-d tensor, as PyTorch keeps it;
//                                       8-bit state's <slot>_codes and <slot>_absmax always whole)
//   optim.param_groups.<g>.<option>     each option of group g (a value); "params": the fqns
//   optim.param_groups.<fqn>.<option>   instead, with flatten_optimizer_state_dict (PyTorch's
//                                       StateDictOptions of that name), one per parameter
//
//   // Save, on every rank (collective): a ZeRO shard writes only what this rank owns.
//   std::vector<DcpWriteItem> items;
//   if (rank == 0) items = dcp_model_items(named_parameters);
//   absl::StatusOr<std::vector<DcpWriteItem>> opt = dcp_optimizer_items(zero.sharded_state(), fqns, rank == 0);
//   items.insert(items.end(), opt->begin(), opt->end());
//   absl::Status s = save_dcp(group, dir, items);
//   // Load, per rank: the pieces it owns now, whatever world size or partition saved them.
//   absl::StatusOr<DcpReader> r = DcpReader::open(dir);
//   absl::StatusOr<ShardedState> mine = load_dcp_optimizer(*r, fqns, zero.owned_ranges(), shapes);
//   zero.load_sharded_state(*mine);
//
// A flat element range of a parameter (ZeRO's flat partition) is written as the boxes that tile
// it in row-major order (a partial first row, whole rows, a partial last row; recursively), so
// PyTorch sees ordinary chunks; reading asks for the same boxes and flattens them back.
#ifndef DTRAIN_CHECKPOINT_DCP_STATE_H_
#define DTRAIN_CHECKPOINT_DCP_STATE_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "checkpoint/dcp.h"
#include "checkpoint/optimizer_state_dict.h"
#include "checkpoint/sharded.h"
#include "partition/flat_partition.h"

namespace dtrain::checkpoint {

struct DcpStateLayout {
  std::string model_key = "model";  // the state dict's key for the model ("model.0.weight")
  std::string optim_key = "optim";  // ... and for the optimizer
  // PyTorch's StateDictOptions(flatten_optimizer_state_dict=True): options keyed per parameter.
  bool flatten_optimizer_state_dict = false;
};

// The boxes (offsets, sizes) that tile the flat range [begin, end) of a row-major tensor of
// `shape`, in order: each covers the next elements of the range. A 0-d tensor is one empty box.
std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> flat_range_boxes(
    const std::vector<int64_t>& shape, partition::Range range);

// Whole tensors under "<model_key>.<name>", for one rank to write (the coordinator).
std::vector<DcpWriteItem> dcp_model_items(
    const std::vector<std::pair<std::string, at::Tensor>>& named,
    const DcpStateLayout& layout = {});

// This rank's optimizer state as DCP items. `fqns[i]` names parameter i. Tensors holding a whole
// parameter are written whole, ranges as their boxes; a parameter's non-sliced entries ("step")
// by the rank holding its first element; param groups (from `state.param_groups`) only when
// `with_param_groups` (the coordinator). Errors: InvalidArgument naming the parameter (an index
// outside fqns, a tensor that does not match its range, a state value DCP cannot hold).
absl::StatusOr<std::vector<DcpWriteItem>> dcp_optimizer_items(const ShardedState& state,
                                                              const std::vector<std::string>& fqns,
                                                              bool with_param_groups,
                                                              const DcpStateLayout& layout = {});

// A whole optimizer state dict as ShardedState (every parameter whole), for optimizers that are
// not sharded. `shapes[i]` is parameter i's shape.
ShardedState whole_sharded_state(const OptimizerStateDict& state_dict,
                                 const std::vector<std::vector<int64_t>>& shapes);

// The model's tensors named `names` (their "<model_key>.<name>" keys), whole, on the CPU.
// Errors: NotFound naming the first missing name; the reader's.
absl::StatusOr<c10::impl::GenericDict> load_dcp_model(const DcpReader& reader,
                                                      const std::vector<std::string>& names,
                                                      const DcpStateLayout& layout = {});

// The optimizer state pieces `wanted` (parameter index -> element range; `shapes[i]` parameter
// i's shape) -- whole parameters
// full-shaped, ranges 1-D -- plus the param groups (params as indices into `fqns`), from the
// chunks that overlap them only. A parameter the checkpoint holds no state for comes back
// without entries (no state yet, as PyTorch's lazy state). The checkpoint's layout (nested or
// flattened groups) is found from its keys. 8-bit state ("<slot>_codes" and "<slot>_absmax",
// optim/functional/state_precision.h: blocks of 256 elements of the whole parameter) is read
// only whole. Errors: InvalidArgument (a group names a parameter not in fqns, shapes that differ
// from `fqns`' parameters', 8-bit state wanted as a range that is not the whole parameter,
// naming what to load it into instead), the reader's.
absl::StatusOr<ShardedState> load_dcp_optimizer(const DcpReader& reader,
                                                const std::vector<std::string>& fqns,
                                                const std::map<int64_t, partition::Range>& wanted,
                                                const std::vector<std::vector<int64_t>>& shapes,
                                                const DcpStateLayout& layout = {});

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_DCP_STATE_H_
