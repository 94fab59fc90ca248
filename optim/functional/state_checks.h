// The checks every optimizer state dict passes before anything of it is applied (functional
// optimizers, the adapter, ZeroRedundancyOptimizer): a state dict comes from a file, so each value
// is checked for type, range, size and finiteness, and a refusal names the key and the parameter's
// index as the file numbers it (not a shard's or a group's local index).
//
//   absl::StatusOr<int64_t> step = loaded_step(entry.at("step"));   // "is nan: ..."
//   if (!step.ok()) return state_error("Adam.load_state_dict", "step", 3, step.status());
//   // -> "Adam.load_state_dict: state 'step' of parameter 3 is nan: ..."
//
// What is refused, and what is kept as PyTorch keeps it:
//   step    a Python int >= 0, or a float / 0-dim or one-element real tensor holding a whole
//           number in [0, 2^63); NaN, inf, negative, fractional, 1e300, strings, bools and tensors
//           of another size are refused (PyTorch would turn them into a NaN or a crash later).
//   tensors dense, floating point (PyTorch casts state to the parameter's dtype; an integer, bool
//           or complex tensor is refused), the shape the optimizer keeps, and finite once cast to
//           the parameter's dtype (a float64 1e300 is inf in float32): NaN or inf optimizer state
//           can only make the parameters NaN. Values PyTorch's update accepts stay accepted: a
//           negative second moment (exp_avg_sq, square_avg, sum) is loaded as it is, and the
//           update then does what PyTorch's does with it (NaN from its square root, as PyTorch).
//   indices param_groups[*]['params'] together hold each of 0..n-1 exactly once; 'state' has
//           entries only for listed indices.
//   options every number of a param group (lr, betas, ...) is finite.
// Messages read well after a "<file>: " prefix and end with what to do.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_STATE_CHECKS_H_
#define DTRAIN_OPTIM_FUNCTIONAL_STATE_CHECKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/optimizer_state_dict.h"

namespace dtrain::optim {

// What the messages advise.
inline constexpr char kLoadAdvice[] =
    "load a state dict saved by this optimizer for these parameters (this one is damaged or was "
    "edited)";

// The step count of a state entry's "step" value; InvalidArgument with what is wrong ("is nan",
// "is a tensor of 2 elements, not one number", ...), to be wrapped by state_error().
absl::StatusOr<int64_t> loaded_step(const c10::IValue& step);

// A state tensor `t` for `param` that `optimizer` ("Adam") keeps with shape `shape`: dense,
// floating point, that shape, finite once cast to the parameter's dtype. InvalidArgument with what
// is wrong ("has shape [5], the parameter has shape [2, 3]"; for a slot of its own shape
// "has shape [3], NAdam keeps it with shape [] for a parameter of shape [3]").
absl::Status check_state_tensor(const at::Tensor& t, const at::Tensor& param,
                                c10::IntArrayRef shape,
                                const std::string& optimizer = "the optimizer");

// An 8-bit slot (state_precision.h) of shape `shape`: `codes` a dense uint8 tensor of that shape,
// `absmax` a dense floating 1-D tensor of quant_blocks(numel) finite scales >= 0. InvalidArgument
// with what is wrong, naming "_codes" or "_absmax".
absl::Status check_8bit_slot(const at::Tensor& codes, const at::Tensor& absmax,
                             c10::IntArrayRef shape);

// A loaded param_remainder (Adam's and AdamW's param_remainders, state_precision.h) for `param`:
// `value` a dense int16 tensor of the parameter's shape, the parameter bfloat16. With `copy`, kept
// in *slot (on the parameter's device) as saved. InvalidArgument naming the key (state_error's
// message, `optimizer`.load_state_dict's), saying what to do.
absl::Status load_param_remainder(const c10::IValue* value, const at::Tensor& param,
                                  const std::string& optimizer, int64_t file_index, bool copy,
                                  at::Tensor* slot);

// "<what>: state '<key>' of parameter <file_index> " + problem's message + "; " + kLoadAdvice.
absl::Status state_error(const std::string& what, const std::string& key, int64_t file_index,
                         const absl::Status& problem);

// The dict's "params" lists against `count` parameters: every index in [0, count), none twice,
// all of them listed; every "state" key one of them. InvalidArgument naming the group, the index
// and what to do. `group_base`: the file's number of the first group (for messages).
absl::Status check_param_indices(const checkpoint::OptimizerStateDict& state_dict, size_t count,
                                 const std::string& what, size_t group_base = 0);

// Every number of a param group's options finite (floats, and the numbers in tuples and lists:
// betas, etas, ...). InvalidArgument "<what>: param_groups[<group>]['lr'] is inf; ...".
absl::Status check_option_numbers(const checkpoint::ParamGroup& group, size_t group_index,
                                  const std::string& what);

// An entry of an optimizer whose state layout is not known here (a LibTorch optimizer's, loaded
// through ZeroRedundancyOptimizer): "step" as loaded_step() wants it, every other value None or a
// state tensor of the parameter's shape (check_state_tensor).
absl::Status check_generic_entry(const checkpoint::StateEntry& entry, const at::Tensor& param,
                                 int64_t file_index, const std::string& what);

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_STATE_CHECKS_H_
