// Functional Adam and AdamW (torch.distributed.optim's _FunctionalAdam / _FunctionalAdamW;
// numerics of PyTorch's single-tensor implementations): AMSGrad, weight decay (L2 for Adam,
// decoupled for AdamW), maximize.
//
//   dtrain::optim::FunctionalAdamW adamw(params, dtrain::optim::AdamWOptions().lr(3e-4).betas({0.9, 0.95}));
//   adamw.step(grads);
//   adamw.set_options(dtrain::optim::AdamWOptions(adamw.options()).weight_decay(0.05));
#ifndef DTRAIN_OPTIM_FUNCTIONAL_ADAM_H_
#define DTRAIN_OPTIM_FUNCTIONAL_ADAM_H_

#include <torch/arg.h>

#include "optim/functional_optimizer_options.h"

namespace dtrain::optim {

struct AdamOptions {
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(DoublePair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  // Fixed before the first step: switching it on later is an error, as in PyTorch (KeyError).
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;
};

struct AdamWOptions {
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(DoublePair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(bool, amsgrad) = false;  // as AdamOptions::amsgrad
  TORCH_ARG(bool, maximize) = false;
};

extern template class TypedFunctionalOptimizer<AdamOptions>;
extern template class TypedFunctionalOptimizer<AdamWOptions>;
using FunctionalAdam = TypedFunctionalOptimizer<AdamOptions>;
using FunctionalAdamW = TypedFunctionalOptimizer<AdamWOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_ADAM_H_
