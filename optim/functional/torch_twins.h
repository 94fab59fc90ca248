// LibTorch's optimizers that have a functional twin -- torch::optim::SGD, Adam, AdamW, Adagrad,
// RMSprop -- in one table: the twin's registry name, the LibTorch options to and from PyTorch's
// option names, a parameter's LibTorch state to and from PyTorch's state entry. The registry
// (twin types, options_from_torch) and the torch::optim state bridge (optim/functional/torch_state.h) are
// built on it; nothing else in dtrain tells these five types apart.
//
//   const TorchTwin* twin = twin_of(optimizer.defaults());          // nullptr: not one of the five
//   OptionsDict d = twin->options_to_dict(optimizer.defaults());     // {"lr": ..., "betas": ...}
//   c10::impl::GenericDict entry = twin->state_to_entry(*param_state);   // {"step", "exp_avg", ...}
//
// Guarantees: option dicts and entries are PyTorch's, for the PyTorch of the LibTorch built
// against. options_to_dict writes every key torch.optim's optimizer of that name puts in a
// param_group -- LibTorch's options under PyTorch's names, and PyTorch's keys LibTorch has no
// field for with the value that says what LibTorch does: maximize, capturable and differentiable
// False, foreach and fused None, and (2.7+, whose Adam and AdamW carry it) decoupled_weight_decay
// False for Adam, True for AdamW. Entries have PyTorch's keys and "step" kind: a float32 0-dim
// tensor for Adam, AdamW, Adagrad and RMSprop, none for SGD (whose state, as PyTorch 2.x's, exists
// only with momentum). optim/functional/state_keys_test compares both with what the installed
// PyTorch writes. So a LibTorch optimizer's state loads into its functional twin and into
// Python's optimizer, and back. Thread safety: the table is built once and never changes.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_TORCH_TWINS_H_
#define DTRAIN_OPTIM_FUNCTIONAL_TORCH_TWINS_H_

#include <functional>
#include <memory>
#include <string>
#include <typeindex>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "optim/functional/optimizer.h"

namespace dtrain::optim {

struct TorchTwin {
  std::string name;           // the functional twin's registry name ("Adam")
  std::type_index optimizer;  // typeid(torch::optim::Adam)
  // Whether `options` / `state` are this optimizer's types.
  std::function<bool(const torch::optim::OptimizerOptions& options)> owns_options;
  std::function<bool(const torch::optim::OptimizerParamState& state)> owns_state;
  // REQUIRES owns_options(options): every option under PyTorch's name, in PyTorch's order.
  std::function<OptionsDict(const torch::optim::OptimizerOptions& options)> options_to_dict;
  // REQUIRES owns_options(options): the keys of `dict` this optimizer has are applied (ints taken
  // as floats), the others ignored -- except a key that changes the math LibTorch cannot follow:
  // maximize=True, or decoupled_weight_decay other than the optimizer's (True for AdamW, False
  // for the rest) is an error (c10::Error naming the key; use the functional twin).
  std::function<void(torch::optim::OptimizerOptions& options, const OptionsDict& dict)>
      apply_options;
  // REQUIRES owns_state(state): PyTorch's state entry (name -> tensor | int | None).
  std::function<c10::impl::GenericDict(const torch::optim::OptimizerParamState& state)>
      state_to_entry;
  // The LibTorch state of `param` from PyTorch's entry (a missing or None tensor stays undefined;
  // "step" may be an int, a float or a one-element tensor). Errors (c10::Error): a tensor whose
  // shape is not the parameter's, naming the state key and `index`; a "step" that is not a whole
  // number from 0 to 2^53.
  std::function<std::unique_ptr<torch::optim::OptimizerParamState>(
      const c10::impl::GenericDict& entry, const at::Tensor& param, int64_t index)>
      state_from_entry;
  // LibTorch's optimizer over `params`: its default options (SGD's lr 1e-3, as PyTorch's) with
  // `options` applied as apply_options applies them.
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> params,
                                                         const OptionsDict& options)>
      make;
};

// SGD, Adam, AdamW, Adagrad, RMSprop.
const std::vector<TorchTwin>& torch_twins();

// The twin registered under `name` ("Adam"); nullptr when that optimizer has no LibTorch twin.
const TorchTwin* twin_named(const std::string& name);

// The twin whose options type (or parameter state type) this is; nullptr when none is.
const TorchTwin* twin_of(const torch::optim::OptimizerOptions& options);
const TorchTwin* twin_of(const torch::optim::OptimizerParamState& state);

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_TORCH_TWINS_H_
