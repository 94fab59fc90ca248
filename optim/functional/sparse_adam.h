// Functional SparseAdam (numerics of PyTorch's torch.optim.SparseAdam): Adam restricted to the
// entries a sparse gradient has -- the moments and the parameter change only where the gradient
// has values (nn.Embedding(sparse=True)'s rows) -- with maximize. It takes sparse COO gradients
// only; a dense one is an error, PyTorch's ("SparseAdam does not support dense gradients, please
// consider Adam instead"). Parameters stay dense.
//
//   dtrain::optim::FunctionalSparseAdam adam(params, dtrain::optim::SparseAdamOptions().lr(1e-3));
//   adam.step({embedding_grad.coalesce()});   // sparse COO, e.g. from nn.Embedding(sparse=True)
//
// State per parameter, as PyTorch's: step (a Python int, counted also for a gradient without
// values), exp_avg, exp_avg_sq.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_SPARSE_ADAM_H_
#define DTRAIN_OPTIM_FUNCTIONAL_SPARSE_ADAM_H_

#include <torch/arg.h>

#include "optim/functional/options.h"

namespace dtrain::optim {

struct SparseAdamOptions {
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(DoublePair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(bool, maximize) = false;
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<SparseAdamOptions>;
using FunctionalSparseAdam = TypedFunctionalOptimizer<SparseAdamOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_SPARSE_ADAM_H_
