// Functional Adadelta (torch.distributed.optim's _FunctionalAdadelta; numerics of PyTorch's
// single-tensor Adadelta): rho, weight decay, maximize.
//
//   dtrain::optim::FunctionalAdadelta adadelta(params, dtrain::optim::AdadeltaOptions().rho(0.95));
//   adadelta.step(grads);
#ifndef DTRAIN_OPTIM_FUNCTIONAL_ADADELTA_H_
#define DTRAIN_OPTIM_FUNCTIONAL_ADADELTA_H_

#include <torch/arg.h>

#include "optim/functional/options.h"

namespace dtrain::optim {

struct AdadeltaOptions {
  TORCH_ARG(double, lr) = 1.0;
  TORCH_ARG(double, rho) = 0.9;
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, maximize) = false;
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<AdadeltaOptions>;
using FunctionalAdadelta = TypedFunctionalOptimizer<AdadeltaOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_ADADELTA_H_
