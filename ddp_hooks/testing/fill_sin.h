// The deterministic weights the DDP and ZeRO-overlap tests start their models from, written once.
//
//   Net net;
//   dtrain::ddp_hooks::fill_sin(*net, /*scale=*/0.5);
#ifndef DTRAIN_DDP_HOOKS_TESTING_FILL_SIN_H_
#define DTRAIN_DDP_HOOKS_TESTING_FILL_SIN_H_

#include <ATen/ATen.h>
#include <torch/nn/module.h>

namespace dtrain::ddp_hooks {

// Parameter k (in parameters() order) becomes sin(0.3 i + k) * scale at its flat index i.
inline void fill_sin(torch::nn::Module& module, double scale) {
  at::NoGradGuard no_grad;
  int k = 0;
  for (auto& p : module.parameters()) {
    p.copy_(at::sin(at::arange(p.numel()).view(p.sizes()) * 0.3 + k++) * scale);
  }
}

}  // namespace dtrain::ddp_hooks

#endif  // DTRAIN_DDP_HOOKS_TESTING_FILL_SIN_H_
