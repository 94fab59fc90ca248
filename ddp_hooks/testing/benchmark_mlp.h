// The model of the DDP benchmarks (//ddp_hooks:ddp_benchmark, //bench:bytes_per_iteration), in
// one place so their figures are of the same model: 8 x Linear(1024, 1024) with ReLUs between,
// 8.4M parameters (32 MiB of float32 gradients), parameter-heavy and FLOP-light.
//
//   torch::nn::Sequential mlp = dtrain::ddp_hooks::benchmark_mlp();
#ifndef DTRAIN_DDP_HOOKS_TESTING_BENCHMARK_MLP_H_
#define DTRAIN_DDP_HOOKS_TESTING_BENCHMARK_MLP_H_

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

namespace dtrain::ddp_hooks {

inline torch::nn::Sequential benchmark_mlp() {
  torch::nn::Sequential mlp;
  for (int i = 0; i < 8; ++i) {
    mlp->push_back(torch::nn::Linear(1024, 1024));
    mlp->push_back(torch::nn::ReLU());
  }
  return mlp;
}

}  // namespace dtrain::ddp_hooks

#endif  // DTRAIN_DDP_HOOKS_TESTING_BENCHMARK_MLP_H_
