// Functional RAdam (numerics of PyTorch's single-tensor torch.optim.RAdam): Adam with the
// variance rectification term of Liu et al. (plain momentum SGD while the approximated SMA length
// is at most 5), L2 or decoupled weight decay (RAdamW), maximize.
//
//   dtrain::optim::FunctionalRAdam radam(params, dtrain::optim::RAdamOptions().lr(1e-3));
//   radam.step(grads);
//
// State per parameter, as PyTorch's: step (0-dim float32), exp_avg, exp_avg_sq.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_RADAM_H_
#define DTRAIN_OPTIM_FUNCTIONAL_RADAM_H_

#include <torch/arg.h>

#include "optim/functional/options.h"

namespace dtrain::optim {

struct RAdamOptions {
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(DoublePair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, decoupled_weight_decay) = false;
  TORCH_ARG(bool, maximize) = false;
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<RAdamOptions>;
using FunctionalRAdam = TypedFunctionalOptimizer<RAdamOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_RADAM_H_
