// The small model of the DDP tests that need a sparse-capable embedding beside dense layers:
// Embedding(vocab, dim) -> Linear(dim, hidden) -> tanh -> Linear(hidden, out), parameters named
// emb, fc1, fc2. One definition for every test that uses it (zero2_hook_test, ddp_gpu_test); each
// picks its sizes.
//
//   struct NetImpl : dtrain::ddp_hooks::EmbeddingMlpImpl {
//     NetImpl() : EmbeddingMlpImpl(/*vocab=*/40, /*dim=*/8, /*hidden=*/16, /*out=*/3) {}
//   };
//   TORCH_MODULE(Net);
#ifndef DTRAIN_DDP_HOOKS_TESTING_EMBEDDING_MLP_H_
#define DTRAIN_DDP_HOOKS_TESTING_EMBEDDING_MLP_H_

#include <cstdint>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

namespace dtrain::ddp_hooks {

struct EmbeddingMlpImpl : torch::nn::Module {
  EmbeddingMlpImpl(int64_t vocab, int64_t dim, int64_t hidden, int64_t out) {
    emb = register_module("emb", torch::nn::Embedding(vocab, dim));
    fc1 = register_module("fc1", torch::nn::Linear(dim, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, out));
  }
  at::Tensor forward(const at::Tensor& idx) { return fc2(at::tanh(fc1(emb(idx)))); }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

}  // namespace dtrain::ddp_hooks

#endif  // DTRAIN_DDP_HOOKS_TESTING_EMBEDDING_MLP_H_
