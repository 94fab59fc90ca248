// Functional Adam and AdamW (torch.distributed.optim's _FunctionalAdam / _FunctionalAdamW;
// numerics of PyTorch's single-tensor implementations): AMSGrad, weight decay (L2 for Adam unless
// decoupled_weight_decay, decoupled for AdamW), maximize. CUDA parameters take ATen's fused
// multi-tensor kernel (at::_fused_adam_ / _fused_adamw_, PyTorch's fused=True numerics) unless
// fused is False.
//
//   dtrain::optim::FunctionalAdamW adamw(params, dtrain::optim::AdamWOptions().lr(3e-4).betas({0.9, 0.95}));
//   adamw.step(grads);
//   // bfloat16 parameters with an exact float32 master in 2 + 2 bytes, 8-bit state:
//   dtrain::optim::FunctionalAdamW lean(bf16_params, dtrain::optim::AdamWOptions().param_remainders(true).state_dtype("8bit"));
//   adamw.set_options(dtrain::optim::AdamWOptions(adamw.options()).weight_decay(0.05));
#ifndef DTRAIN_OPTIM_FUNCTIONAL_ADAM_H_
#define DTRAIN_OPTIM_FUNCTIONAL_ADAM_H_

#include <torch/arg.h>

#include "optim/functional/options.h"

namespace dtrain::optim {

struct AdamOptions {
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(DoublePair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  // Fixed before the first step: switching it on later is an error, as in PyTorch (KeyError).
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;
  // PyTorch's `fused`. None (the default) or True: CUDA parameters are updated by ATen's fused
  // multi-tensor kernel, one launch per (device, dtype); False: by the per-tensor ATen ops
  // (PyTorch's single-tensor numerics). CPU parameters take dtrain's own fused CPU kernel (PyTorch's
  // single-tensor numerics, bit for bit) unless fused is True: then ATen's CPU fused kernel, as
  // PyTorch's fused=True (its numerics, its speed). Unlike PyTorch, whose default on CUDA is
  // foreach, dtrain defaults to the fused kernel there.
  TORCH_ARG(OptionalBool, fused) = std::nullopt;
  // PyTorch 2.7+'s decoupled_weight_decay: True makes this Adam an AdamW (weight decay applied to
  // the parameter, not added to the gradient). Built against LibTorch 2.6 (whose Adam has no such
  // option) True is refused.
  TORCH_ARG(bool, decoupled_weight_decay) = false;
  // A float32 master weight for bfloat16 parameters as the parameter plus a 16-bit remainder:
  // dtrain's (TransformerEngine FusedAdam's store_param_remainders, Megatron-Core's
  // store_param_remainders). False (the default): the update runs in the parameter's dtype, as
  // PyTorch's. True: bfloat16 parameters only (any other is refused at construction and at
  // step); each keeps an int16 state slot "param_remainder" of its shape so that (bfloat16 bits,
  // remainder) hold an exact float32 master weight (state_precision.h's split_master: the
  // parameter is the master rounded to nearest, ties away from zero). The update is the float32
  // update of that master, bit for bit as for a float32 parameter equal to it, with the bfloat16
  // gradient converted to float32; state_dtype=None then keeps state in float32 (the master's
  // dtype), "bfloat16" and "8bit" as for a float32 parameter. Combines with every other option
  // (amsgrad, maximize, fused, state_dtype). A parameter's first step starts from remainder 0
  // (the master equals the bfloat16 value); switching it off drops the remainders at the next
  // step. State dicts: the remainder is an int16 tensor under "param_remainder" and the group
  // records param_remainders=True (left out while False); PyTorch's Adam ignores both keys, but
  // its load_state_dict casts the remainder to the parameter's bfloat16, so a state dict that
  // went through PyTorch has lost it (dtrain refuses a non-int16 remainder, saying so).
  // 2 + 2 bytes per parameter instead of a float32 master's 4 + 2 (docs/differences.md).
  TORCH_ARG(bool, param_remainders) = false;
  DTRAIN_STATE_PRECISION_ARGS;
};

struct AdamWOptions {
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(DoublePair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(bool, amsgrad) = false;  // as AdamOptions::amsgrad
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(OptionalBool, fused) = std::nullopt;  // as AdamOptions::fused
  TORCH_ARG(bool, param_remainders) = false;      // as AdamOptions::param_remainders
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<AdamOptions>;
extern template class TypedFunctionalOptimizer<AdamWOptions>;
using FunctionalAdam = TypedFunctionalOptimizer<AdamOptions>;
using FunctionalAdamW = TypedFunctionalOptimizer<AdamWOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_ADAM_H_
