// Functional SGD (torch.distributed.optim's _FunctionalSGD; numerics of PyTorch's single-tensor
// SGD): momentum, dampening, Nesterov, weight decay, maximize.
//
//   dtrain::optim::FunctionalSGD sgd(params, dtrain::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
//   sgd.step(grads);                              // one optional gradient per parameter
#ifndef DTRAIN_OPTIM_FUNCTIONAL_SGD_H_
#define DTRAIN_OPTIM_FUNCTIONAL_SGD_H_

#include <torch/arg.h>

#include "optim/functional_optimizer_options.h"

namespace dtrain::optim {

struct SGDOptions {
  explicit SGDOptions(double lr) : lr_(lr) {}  // lr has no default, as in PyTorch
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(bool, maximize) = false;
};

extern template class TypedFunctionalOptimizer<SGDOptions>;
using FunctionalSGD = TypedFunctionalOptimizer<SGDOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_SGD_H_
