// Functional NAdam (numerics of PyTorch's single-tensor torch.optim.NAdam): Adam with Nesterov
// momentum and a momentum schedule (momentum_decay), L2 or decoupled weight decay (NAdamW),
// maximize.
//
//   dtrain::optim::FunctionalNAdam nadam(params, dtrain::optim::NAdamOptions().lr(1e-3));
//   nadam.step(grads);
//
// State per parameter, as PyTorch's: step (0-dim float32), mu_product (0-dim float32 on the CPU;
// after load_state_dict in the parameter's dtype, as PyTorch casts it), exp_avg, exp_avg_sq.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_NADAM_H_
#define DTRAIN_OPTIM_FUNCTIONAL_NADAM_H_

#include <torch/arg.h>

#include "optim/functional/options.h"

namespace dtrain::optim {

struct NAdamOptions {
  TORCH_ARG(double, lr) = 2e-3;
  TORCH_ARG(DoublePair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(double, momentum_decay) = 4e-3;
  TORCH_ARG(bool, decoupled_weight_decay) = false;
  TORCH_ARG(bool, maximize) = false;
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<NAdamOptions>;
using FunctionalNAdam = TypedFunctionalOptimizer<NAdamOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_NADAM_H_
