// Functional Adagrad (torch.distributed.optim's _FunctionalAdagrad; numerics of PyTorch's
// single-tensor Adagrad): lr decay, weight decay, initial accumulator, maximize. Like PyTorch's,
// it creates every parameter's state at construction.
//
//   dtrain::optim::FunctionalAdagrad adagrad(params, dtrain::optim::AdagradOptions().lr(0.1).lr_decay(1e-3));
//   adagrad.step(grads);
#ifndef DTRAIN_OPTIM_FUNCTIONAL_ADAGRAD_H_
#define DTRAIN_OPTIM_FUNCTIONAL_ADAGRAD_H_

#include <torch/arg.h>

#include "optim/functional_optimizer_options.h"

namespace dtrain::optim {

struct AdagradOptions {
  TORCH_ARG(double, lr) = 1e-2;
  TORCH_ARG(double, lr_decay) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(double, initial_accumulator_value) = 0;
  TORCH_ARG(double, eps) = 1e-10;
  TORCH_ARG(bool, maximize) = false;
};

extern template class TypedFunctionalOptimizer<AdagradOptions>;
using FunctionalAdagrad = TypedFunctionalOptimizer<AdagradOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_ADAGRAD_H_
