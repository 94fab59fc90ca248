// Functional Adafactor (numerics of PyTorch's single-tensor torch.optim.Adafactor, Shazeer & Stern
// with PyTorch's choices): the second moment of a parameter with 2 or more dimensions is kept
// factored over its last two (row_var, col_var), a vector's whole (variance); relative step
// sizes, update clipping by d, decoupled weight decay, maximize. Not elementwise: no fused kernel.
//
//   dtrain::optim::FunctionalAdafactor adafactor(params, dtrain::optim::AdafactorOptions().lr(1e-2));
//   adafactor.step(grads);
//
// eps is (eps1, eps2): eps1 unset (Python's None) is the parameter dtype's machine epsilon
// (torch.finfo(dtype).eps). PyTorch takes the first updated parameter's dtype for all of a step's
// parameters; dtrain each parameter's own, the same wherever the parameters share one dtype.
// State per parameter, as PyTorch's: step (0-dim float32); row_var (the gradient's shape with the
// last dimension 1) and col_var (the second-to-last 1), or variance for fewer than 2 dimensions.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_ADAFACTOR_H_
#define DTRAIN_OPTIM_FUNCTIONAL_ADAFACTOR_H_

#include <optional>

#include <torch/arg.h>

#include "optim/functional/options.h"

namespace dtrain::optim {

struct AdafactorOptions {
  TORCH_ARG(double, lr) = 1e-2;
  TORCH_ARG(double, beta2_decay) = -0.8;
  TORCH_ARG(OptionalDoublePair, eps) = std::make_tuple(std::optional<double>(), 1e-3);
  TORCH_ARG(double, d) = 1.0;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, maximize) = false;
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<AdafactorOptions>;
using FunctionalAdafactor = TypedFunctionalOptimizer<AdafactorOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_ADAFACTOR_H_
