// Functional Adamax (torch.distributed.optim's _FunctionalAdamax; numerics of PyTorch's
// single-tensor Adamax): weight decay, maximize.
//
//   dtrain::optim::FunctionalAdamax adamax(params, dtrain::optim::AdamaxOptions().lr(2e-3));
//   adamax.step(grads);
//
// Default lr: AdamaxOptions() has torch.optim.Adamax's 2e-3; the registry ("Adamax" with no lr:
// FunctionalOptimizerAdapter, ZeroRedundancyOptimizer, rpc::DistributedOptimizer) starts from
// 1e-3, the default of PyTorch's _FunctionalAdamax, which those paths use in PyTorch.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_ADAMAX_H_
#define DTRAIN_OPTIM_FUNCTIONAL_ADAMAX_H_

#include <torch/arg.h>

#include "optim/functional/options.h"

namespace dtrain::optim {

struct AdamaxOptions {
  TORCH_ARG(double, lr) = 2e-3;
  TORCH_ARG(DoublePair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, maximize) = false;
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<AdamaxOptions>;
using FunctionalAdamax = TypedFunctionalOptimizer<AdamaxOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_ADAMAX_H_
