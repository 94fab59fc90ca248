// Functional Adam and AdamW (torch.distributed.optim's _FunctionalAdam / _FunctionalAdamW;
// numerics of PyTorch's single-tensor implementations): AMSGrad, weight decay (L2 for Adam unless
// decoupled_weight_decay, decoupled for AdamW), maximize. CUDA parameters take ATen's fused
// multi-tensor kernel (at::_fused_adam_ / _fused_adamw_, PyTorch's fused=True numerics) unless
// fused is False.
//
//   dtrain::optim::FunctionalAdamW adamw(params, dtrain::optim::AdamWOptions().lr(3e-4).betas({0.9, 0.95}));
//   adamw.step(grads);
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
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<AdamOptions>;
extern template class TypedFunctionalOptimizer<AdamWOptions>;
using FunctionalAdam = TypedFunctionalOptimizer<AdamOptions>;
using FunctionalAdamW = TypedFunctionalOptimizer<AdamWOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_ADAM_H_
