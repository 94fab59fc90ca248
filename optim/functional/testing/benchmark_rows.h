// The optimizer rows of the optimizer benchmarks (optimizers_benchmark, optimizers_cuda_benchmark)
// in one place: each row's kind, its registry name and its LibTorch twin with PyTorch's defaults
// (optim/functional/torch_twins.h), so that the CPU and CUDA tables compare the same optimizers.
//
//   std::unique_ptr<torch::optim::Optimizer> peer = make_torch(BenchKind::kAdamW, params);
#ifndef DTRAIN_OPTIM_FUNCTIONAL_TESTING_BENCHMARK_ROWS_H_
#define DTRAIN_OPTIM_FUNCTIONAL_TESTING_BENCHMARK_ROWS_H_

#include <memory>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "optim/functional/torch_twins.h"

namespace dtrain::optim {

// kSGDMomentum: SGD with momentum 0.9; every other row its optimizer's defaults (SGD's lr 1e-3).
enum class BenchKind {
  kSGD,
  kSGDMomentum,
  kAdam,
  kAdamW,
  kAdagrad,
  kAdadelta,
  kAdamax,
  kRMSprop,
  kRprop
};

// The functional optimizer's registry name (its LibTorch twin's, when it has one).
inline const char* registry_name(BenchKind k) {
  switch (k) {
    case BenchKind::kSGD:
    case BenchKind::kSGDMomentum:
      return "SGD";
    case BenchKind::kAdam:
      return "Adam";
    case BenchKind::kAdamW:
      return "AdamW";
    case BenchKind::kAdagrad:
      return "Adagrad";
    case BenchKind::kAdadelta:
      return "Adadelta";
    case BenchKind::kAdamax:
      return "Adamax";
    case BenchKind::kRMSprop:
      return "RMSprop";
    case BenchKind::kRprop:
      return "Rprop";
  }
  return "";
}

// LibTorch's optimizer of row `k` over `params`; nullptr when the optimizer has no LibTorch twin.
inline std::unique_ptr<torch::optim::Optimizer> make_torch(BenchKind k,
                                                           std::vector<at::Tensor> params) {
  const TorchTwin* twin = twin_named(registry_name(k));
  if (twin == nullptr) return nullptr;
  OptionsDict options = new_options_dict();
  if (k == BenchKind::kSGDMomentum) options.insert("momentum", 0.9);
  return twin->make(std::move(params), options);
}

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_TESTING_BENCHMARK_ROWS_H_
