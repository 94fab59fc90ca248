// Functional RMSprop (torch.distributed.optim's _FunctionalRMSprop; numerics of PyTorch's
// single-tensor RMSprop): momentum, centered, weight decay, maximize.
//
//   dtrain::optim::FunctionalRMSprop rmsprop(params, dtrain::optim::RMSpropOptions().momentum(0.9));
//   rmsprop.step(grads);
#ifndef DTRAIN_OPTIM_FUNCTIONAL_RMSPROP_H_
#define DTRAIN_OPTIM_FUNCTIONAL_RMSPROP_H_

#include <torch/arg.h>

#include "optim/functional/options.h"

namespace dtrain::optim {

struct RMSpropOptions {
  TORCH_ARG(double, lr) = 1e-2;
  TORCH_ARG(double, alpha) = 0.99;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  // momentum > 0 and centered are fixed before the first step: switching either on later is an
  // error, as in PyTorch (KeyError: 'momentum_buffer' / 'grad_avg').
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(bool, centered) = false;
  TORCH_ARG(bool, maximize) = false;
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<RMSpropOptions>;
using FunctionalRMSprop = TypedFunctionalOptimizer<RMSpropOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_RMSPROP_H_
