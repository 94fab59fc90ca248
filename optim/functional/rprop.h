// Functional Rprop (torch.distributed.optim's _FunctionalRprop; numerics of PyTorch's
// single-tensor Rprop): etas, step size bounds, maximize.
//
//   dtrain::optim::FunctionalRprop rprop(params, dtrain::optim::RpropOptions().etas({0.5, 1.2}));
//   rprop.step(grads);
#ifndef DTRAIN_OPTIM_FUNCTIONAL_RPROP_H_
#define DTRAIN_OPTIM_FUNCTIONAL_RPROP_H_

#include <torch/arg.h>

#include "optim/functional/options.h"

namespace dtrain::optim {

struct RpropOptions {
  TORCH_ARG(double, lr) = 1e-2;
  TORCH_ARG(DoublePair, etas) = std::make_tuple(0.5, 1.2);
  TORCH_ARG(DoublePair, step_sizes) = std::make_tuple(1e-6, 50.0);
  TORCH_ARG(bool, maximize) = false;
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<RpropOptions>;
using FunctionalRprop = TypedFunctionalOptimizer<RpropOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_RPROP_H_
