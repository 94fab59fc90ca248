// The small dense model of the ZeRO-overlap tests: Linear(in, h1) -> relu -> Linear(h1, h2) ->
// tanh -> Linear(h2, out), parameters named fc1, fc2, fc3, and the deterministic weights those
// tests start from (testing/fill_sin.h). One definition for every test that uses it; each picks
// its sizes.
//
//   struct NetImpl : dtrain::ddp_hooks::ThreeLayerMlpImpl {
//     NetImpl() : ThreeLayerMlpImpl(/*in=*/4, /*h1=*/8, /*h2=*/6, /*out=*/3) {}
//   };
//   TORCH_MODULE(Net);
#ifndef DTRAIN_DDP_HOOKS_TESTING_THREE_LAYER_MLP_H_
#define DTRAIN_DDP_HOOKS_TESTING_THREE_LAYER_MLP_H_

#include <cstdint>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace dtrain::ddp_hooks {

struct ThreeLayerMlpImpl : torch::nn::Module {
  ThreeLayerMlpImpl(int64_t in, int64_t h1, int64_t h2, int64_t out) {
    fc1 = register_module("fc1", torch::nn::Linear(in, h1));
    fc2 = register_module("fc2", torch::nn::Linear(h1, h2));
    fc3 = register_module("fc3", torch::nn::Linear(h2, out));
  }
  at::Tensor forward(const at::Tensor& x) { return fc3(at::tanh(fc2(at::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

}  // namespace dtrain::ddp_hooks

#endif  // DTRAIN_DDP_HOOKS_TESTING_THREE_LAYER_MLP_H_
