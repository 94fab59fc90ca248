// State moves between LibTorch's torch::optim optimizers and dtrain's (functional, adapter, ZeRO)
// through PyTorch's optimizer state_dict format.
//
//   torch::optim::Adam adam(params, torch::optim::AdamOptions(1e-3));
//   ... train ...
//   c10::IValue sd = dtrain::optim::torch_optim_state_dict(adam);   // PyTorch's optimizer state dict
//   dtrain::optim::FunctionalAdam functional(params, dtrain::optim::AdamOptions());
//   functional.load_state_dict(sd);                                  // continues where Adam was
//   dtrain::optim::load_torch_optim_state_dict(adam, functional.state_dict());   // and back
//
// Supported: torch::optim::SGD, Adam, AdamW, Adagrad, RMSprop (the LibTorch twins of the
// registry, optim/functional/torch_twins.h). Parameters are indexed across param groups in order, as PyTorch
// does. The dicts are checkpoint/optimizer_state_dict.h's model, emitted and parsed there.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_TORCH_STATE_H_
#define DTRAIN_OPTIM_FUNCTIONAL_TORCH_STATE_H_

#include <ATen/core/ivalue.h>
#include <torch/optim/optimizer.h>

namespace dtrain::optim {

// The optimizer's state and param groups in PyTorch's format. TORCH_CHECK on an unsupported type.
c10::IValue torch_optim_state_dict(const torch::optim::Optimizer& optimizer);

// Replaces the optimizer's state (and its groups' options) with `state_dict`. The number of
// groups and of parameters per group must match; state tensors must match their parameter's shape.
// Errors (c10::Error): those, and a dict not in PyTorch's format (the parse error).
void load_torch_optim_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state_dict);

// Any local optimizer (ZeRO's, PostLocalSGD's): a FunctionalOptimizerAdapter's state_dict() /
// load_state_dict(), else the two functions above.
c10::IValue optimizer_state_dict(torch::optim::Optimizer& optimizer);
void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state_dict);

// Bytes held by the tensors of a PyTorch-format optimizer state dict's state (what sharding
// divides among ranks; step counters that are Python ints count nothing).
int64_t state_tensor_bytes(const c10::IValue& state_dict);

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_TORCH_STATE_H_
