// Functional Muon (numerics of PyTorch's torch.optim.Muon): momentum (Nesterov by default), the
// update orthogonalised by a Newton-Schulz iteration in bfloat16, decoupled weight decay and a
// shape-dependent learning-rate adjustment (adjust_lr_fn: None or "original", "match_rms_adamw",
// "spectral_unclamped"). For 2-D parameters only, as PyTorch's: any other is an error at
// construction; give biases, embeddings and the like to another optimizer (AdamW).
//
//   dtrain::optim::FunctionalMuon muon(hidden_weights, dtrain::optim::MuonOptions().lr(0.02));
//   muon.step(grads);
//
// ns_steps >= 100 is refused when the options are set (PyTorch refuses it at its first step).
// State per parameter, as PyTorch's: momentum_buffer only (no step).
#ifndef DTRAIN_OPTIM_FUNCTIONAL_MUON_H_
#define DTRAIN_OPTIM_FUNCTIONAL_MUON_H_

#include <torch/arg.h>

#include "optim/functional/options.h"

namespace dtrain::optim {

struct MuonOptions {
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, weight_decay) = 0.1;
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  TORCH_ARG(DoubleTriple, ns_coefficients) = std::make_tuple(3.4445, -4.7750, 2.0315);
  TORCH_ARG(double, eps) = 1e-7;
  TORCH_ARG(int64_t, ns_steps) = 5;
  TORCH_ARG(OptionalString, adjust_lr_fn) = std::nullopt;
  DTRAIN_STATE_PRECISION_ARGS;
};

extern template class TypedFunctionalOptimizer<MuonOptions>;
using FunctionalMuon = TypedFunctionalOptimizer<MuonOptions>;

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_MUON_H_
