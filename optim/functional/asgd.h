// Functional ASGD (numerics of PyTorch's single-tensor torch.optim.ASGD): averaged SGD with a
// decaying step size eta = lr / (1 + lambd * lr * step)^alpha and the average `ax` of the iterates
// from step t0 on; weight decay, maximize.
//
//   dtrain::optim::FunctionalASGD asgd(params, dtrain::optim::ASGDOptions().lr(0.01).t0(100));
//   asgd.step(grads);
//   // the averaged parameters: state_dict()["state"][i]["ax"]
//
// State per parameter, as PyTorch's: step (0-dim float32), eta and mu (0-dim float32 on the CPU;
// after load_state_dict in the parameter's dtype, as PyTorch casts them), ax.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_ASGD_H_
#define DTRAIN_OPTIM_FUNCTIONAL_ASGD_H_

#include <torch/arg.h>

#include "optim/functional/options.h"

namespace dtrain::optim {

struct ASGDOptions {
  TORCH_ARG(double, lr) = 1e-2;
  TORCH_ARG(double, lambd) = 1e-4;
  TORCH_ARG(double, alpha) = 0.75;
  TORCH_ARG(double, t0) = 1e6;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, maximize) = false;
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<ASGDOptions>;
using FunctionalASGD = TypedFunctionalOptimizer<ASGDOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_ASGD_H_
