// PyTorch's optimizer state dict as a typed value: the one place that parses and emits
// {"state": {index: {name: value}}, "param_groups": [{options..., "params": [indices]}]}, used by
// optim/ (functional optimizers, the adapter, the torch::optim bridge, ZeRO) and checkpoint/
// (consolidation, sharded checkpoints) alike. It lives in checkpoint/ because it is the file
// format, not an optimizer: checkpoint never includes optim (docs/ARCHITECTURE.md).
//
//   absl::StatusOr<OptimizerStateDict> sd = parse_optimizer_state_dict(ivalue, "the state dict");
//   if (!sd.ok()) return sd.status();     // "the state dict: param group 0 has no 'params'"
//   OptimizerStateDict group1 = group_slice(*sd, 1);     // group 1 alone, indices 0..n-1
//   OptimizerStateDict whole = concatenate({group0, group1});   // back: indices follow on
//   c10::IValue out = to_ivalue(whole);   // what PyTorch's Optimizer.state_dict() returns
//
// Guarantees: parse keeps everything PyTorch keeps -- each state entry as it is (its keys in
// order, values untouched: tensors, ints, floats, None), each group's keys other than "params" in
// order, unknown ones included (an LR scheduler's "initial_lr", a user's own). to_ivalue emits
// "state" then "param_groups"; state in ascending index order (what every dtrain emitter wrote),
// each group's options in order and then "params" (a List[int]) last, as PyTorch's state_dict()
// does. Top-level keys other than the two are not part of the model (parse ignores them).
// Values are shared, not copied (c10 dicts and tensors are references): copy before mutating an
// entry another holder sees. Thread safety: plain values; the functions share nothing.
#ifndef DTRAIN_CHECKPOINT_OPTIMIZER_STATE_DICT_H_
#define DTRAIN_CHECKPOINT_OPTIMIZER_STATE_DICT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"

namespace dtrain::checkpoint {

// The two keys of the format, for formats that embed a part of it (sharded metadata).
inline constexpr char kStateKey[] = "state";
inline constexpr char kParamGroupsKey[] = "param_groups";

// One parameter's state: name -> tensor | int | float | None ("step", "exp_avg", ...).
using StateEntry = c10::impl::GenericDict;

struct ParamGroup {
  std::vector<int64_t> params;  // parameter indices, in the group's order
  // Every key but "params", in order (str -> any).
  c10::impl::GenericDict options{c10::StringType::get(), c10::AnyType::get()};
};

struct OptimizerStateDict {
  std::map<int64_t, StateEntry> state;  // by parameter index; parameters without state absent
  std::vector<ParamGroup> param_groups;
};

// An empty StateEntry / options dict (string keys, any values).
StateEntry new_state_entry();

// Parses PyTorch's format (from dtrain, LibTorch via optim/functional/torch_state.h, or Python's torch.load:
// typed or Any-keyed dicts and lists alike). `what` names the dict in errors. InvalidArgument
// "<what> is not a dict (got Int)", "<what> needs keys 'state' and 'param_groups'", or
// "<what>: " + the part that is wrong ("state keys must be integer parameter indices",
// "state[3] is not a dict", "param group 1 has no 'params'", ...).
absl::StatusOr<OptimizerStateDict> parse_optimizer_state_dict(const c10::IValue& state_dict,
                                                              const std::string& what);
// Only a "param_groups" list (as sharded metadata keeps it); errors as above.
absl::StatusOr<std::vector<ParamGroup>> parse_param_groups(const c10::IValue& groups,
                                                           const std::string& what);

// PyTorch's format (see the guarantees above).
c10::IValue to_ivalue(const OptimizerStateDict& state_dict);
c10::IValue param_groups_to_ivalue(const std::vector<ParamGroup>& groups);

// Parameter i renamed new_index[i], in "state" and in every group's "params".
// REQUIRES every index in `state_dict` to be in [0, new_index.size()) (TORCH_CHECK).
OptimizerStateDict reindexed(const OptimizerStateDict& state_dict,
                             const std::vector<int64_t>& new_index);

// Group `group` alone, its parameters renumbered 0..n-1 in its "params" order, with their state.
// REQUIRES group < param_groups.size() (TORCH_CHECK).
OptimizerStateDict group_slice(const OptimizerStateDict& state_dict, size_t group);

// The parts' groups one after another; part k's indices shifted by the number of parameters the
// groups of parts 0..k-1 list (so parts indexed 0..n-1 each number on from each other).
OptimizerStateDict concatenate(const std::vector<OptimizerStateDict>& parts);

// Rank-local parts of one optimizer -> the global dict (consolidation): "state" the union
// (InvalidArgument naming both parts when an index is in two), group g's options those of
// parts[options_from], its "params" the sorted union of every part's group g. InvalidArgument
// when the parts' group counts differ or options_from is out of range.
absl::StatusOr<OptimizerStateDict> merge(const std::vector<OptimizerStateDict>& parts,
                                         size_t options_from);

// Bytes held by the state's tensors (step counters that are Python ints count nothing).
int64_t state_tensor_bytes(const OptimizerStateDict& state_dict);

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_OPTIMIZER_STATE_DICT_H_
