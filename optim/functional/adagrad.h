// Functional Adagrad (torch.distributed.optim's _FunctionalAdagrad; numerics of PyTorch's
// single-tensor Adagrad): lr decay, weight decay, initial accumulator, maximize. Like PyTorch's,
// it creates every parameter's state at construction. CUDA parameters take ATen's fused
// multi-tensor kernel (at::_fused_adagrad_) where the LibTorch has one for CUDA (2.11, 2.14; not
// 2.6, where PyTorch's foreach sequence of _foreach_ ops runs instead) unless fused is False.
//
//   dtrain::optim::FunctionalAdagrad adagrad(params, dtrain::optim::AdagradOptions().lr(0.1).lr_decay(1e-3));
//   adagrad.step(grads);
#ifndef DTRAIN_OPTIM_FUNCTIONAL_ADAGRAD_H_
#define DTRAIN_OPTIM_FUNCTIONAL_ADAGRAD_H_

#include <torch/arg.h>

#include "optim/functional/options.h"

namespace dtrain::optim {

struct AdagradOptions {
  TORCH_ARG(double, lr) = 1e-2;
  TORCH_ARG(double, lr_decay) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(double, initial_accumulator_value) = 0;
  TORCH_ARG(double, eps) = 1e-10;
  TORCH_ARG(bool, maximize) = false;
  // PyTorch's `fused`: None (the default) or True runs CUDA parameters through ATen's fused (or,
  // without a CUDA kernel, foreach) multi-tensor path, False through the per-tensor ATen ops; CPU
  // parameters take dtrain's fused CPU kernel either way (see AdamOptions::fused).
  TORCH_ARG(OptionalBool, fused) = std::nullopt;
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<AdagradOptions>;
using FunctionalAdagrad = TypedFunctionalOptimizer<AdagradOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_ADAGRAD_H_
