// Functional SGD (torch.distributed.optim's _FunctionalSGD; numerics of PyTorch's single-tensor
// SGD): momentum, dampening, Nesterov, weight decay, maximize. CUDA parameters take ATen's fused
// multi-tensor kernel (at::_fused_sgd_, PyTorch's fused=True numerics) unless fused is False.
//
//   dtrain::optim::FunctionalSGD sgd(params, dtrain::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
//   sgd.step(grads);                              // one optional gradient per parameter
#ifndef DTRAIN_OPTIM_FUNCTIONAL_SGD_H_
#define DTRAIN_OPTIM_FUNCTIONAL_SGD_H_

#include <torch/arg.h>

#include "optim/functional/options.h"

namespace dtrain::optim {

struct SGDOptions {
  explicit SGDOptions(double lr) : lr_(lr) {}  // lr has no default, as in PyTorch
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(bool, maximize) = false;
  // PyTorch's `fused`: None (the default) or True runs CUDA parameters through at::_fused_sgd_,
  // False through the per-tensor ATen ops; CPU parameters take dtrain's fused CPU kernel unless
  // fused is True, then at::_fused_sgd_ on CPU as PyTorch (see AdamOptions::fused).
  TORCH_ARG(OptionalBool, fused) = std::nullopt;
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<SGDOptions>;
using FunctionalSGD = TypedFunctionalOptimizer<SGDOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_SGD_H_
