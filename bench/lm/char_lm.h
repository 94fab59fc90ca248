// A small GPT-like character (byte) language model and its data: the benchmark task on which
// optimizers and optimizer-state precisions (fp32, bf16, 8-bit) can be told apart, which the
// teacher-MLP task of examples/train cannot (it plateaus). bench/lm/lm_peer.py is its PyTorch twin:
// the same parameter names and shapes, the same forward pass op for op, the same data and the
// same batches in the same order (the sampler below is splitmix64, written identically there).
//
//   dtrain::bench::CharLMOptions o;                      // d_model 192, 4 layers, 4 heads, 128
//   dtrain::bench::CharLM model(o);                      // deterministic init from o.seed
//   absl::StatusOr<TextData> text = load_text({"/usr/share/common-licenses"});
//   Batch b = sample_batch(text->train, /*batch_size=*/32, o.context, /*seed=*/0,
//                          kTrainStream, /*step=*/1);
//   at::Tensor loss = model->loss(b.inputs, b.targets);  // mean cross-entropy, nats per byte
//
// Model: token embedding + learned position embedding, n_layers pre-LayerNorm blocks (causal
// self-attention with plain matmuls, a -inf causal mask and softmax; an MLP mlp_ratio x wide with
// exact GELU), a final LayerNorm and a linear head without bias. Parameters are named as in
// PyTorch's nn.Module ("blocks.0.attn.qkv.weight").
//
// Data: the bytes of the given files (a directory stands for its regular files, recursively;
// symbolic links are skipped so a license is not read twice through its alias), concatenated in
// sorted path order; the last 10% (n / 10 bytes) is the validation split.
//
// Thread safety: a model is a torch::nn::Module (one thread at a time); the free functions are
// safe to call concurrently.
#ifndef DTRAIN_BENCH_LM_CHAR_LM_H_
#define DTRAIN_BENCH_LM_CHAR_LM_H_

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dtrain::bench {

struct CharLMOptions {
  int64_t vocab_size = 256;  // bytes
  int64_t d_model = 192;     // width of the residual stream; a multiple of n_heads
  int64_t n_layers = 4;      // transformer blocks
  int64_t n_heads = 4;       // attention heads per block
  int64_t context = 128;     // longest sequence (position embeddings)
  int64_t mlp_ratio = 4;     // MLP hidden width = mlp_ratio * d_model
  double init_std = 0.02;    // N(0, init_std) weights; residual projections / sqrt(2 n_layers)
  uint64_t seed = 0;         // of the initial weights
  // TORCH_CHECK that every size is positive and d_model divides into n_heads.
  void check() const;
};

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  CausalSelfAttentionImpl(int64_t d_model, int64_t n_heads);
  at::Tensor forward(const at::Tensor& x);  // [B, T, C] -> [B, T, C]

 private:
  int64_t n_heads_;
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(int64_t d_model, int64_t hidden);
  at::Tensor forward(const at::Tensor& x);

 private:
  torch::nn::Linear fc_{nullptr}, proj_{nullptr};
};
TORCH_MODULE(Mlp);

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t d_model, int64_t n_heads, int64_t mlp_hidden);
  at::Tensor forward(const at::Tensor& x);  // x + attn(ln1(x)), then + mlp(ln2(.))

 private:
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  CausalSelfAttention attn_{nullptr};
  Mlp mlp_{nullptr};
};
TORCH_MODULE(Block);

class CharLMImpl : public torch::nn::Module {
 public:
  explicit CharLMImpl(const CharLMOptions& options);
  // tokens: int64 [B, T], T <= context, values < vocab_size. Returns logits [B, T, vocab_size].
  at::Tensor forward(const at::Tensor& tokens);
  // Mean cross-entropy of forward(inputs) against targets (int64 [B, T]), in float32.
  at::Tensor loss(const at::Tensor& inputs, const at::Tensor& targets);
  // Re-draws every parameter from `seed` (what the constructor does with options.seed): Linear and
  // embedding weights N(0, init_std), the residual projections (attn.proj, mlp.proj) N(0,
  // init_std / sqrt(2 n_layers)), biases 0, LayerNorm weights 1. Same values as lm_peer.py's.
  void reset_parameters(uint64_t seed);
  int64_t parameter_count() const;
  const CharLMOptions& options() const { return options_; }

 private:
  CharLMOptions options_;
  torch::nn::Embedding tok_emb_{nullptr}, pos_emb_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(CharLM);

// The weights as a Dict[str, Tensor] file (checkpoint/state_file.h) that Python's torch.load
// reads; load_weights also reads torch.save(model.state_dict()) files. Errors: the file's (I/O,
// DataLoss), and InvalidArgument naming a missing, unexpected or misshapen parameter.
absl::Status save_weights(CharLM& model, const std::string& path);
absl::Status load_weights(CharLM& model, const std::string& path);

// ---- Data ----

// splitmix64's output function on z + 0x9E3779B97F4A7C15 (splitmix64(0) = 0xE220A8397B1DCDAF).
uint64_t splitmix64(uint64_t z);
// The start of sequence `index` of step `step` in a split with `count` possible starts:
// h = splitmix64(seed); h = splitmix64(h ^ stream); h = splitmix64(h ^ step);
// h = splitmix64(h ^ index); return h % count. REQUIRES count > 0.
uint64_t sample_offset(uint64_t seed, uint64_t stream, uint64_t step, uint64_t index,
                       uint64_t count);
inline constexpr uint64_t kTrainStream = 0;  // training batches, step = 1, 2, ...
inline constexpr uint64_t kValStream = 1;    // validation batches, step = 0 .. eval_batches-1

struct TextData {
  std::vector<std::string> files;  // in the order read
  int64_t total_bytes = 0;
  at::Tensor train, val;  // uint8, the first n - n/10 bytes and the last n/10
};

// The files `entries` name (a directory: its regular files, recursively; symbolic links skipped),
// sorted by path, without repeats. NotFound when an entry does not exist, InvalidArgument when
// nothing is left.
absl::StatusOr<std::vector<std::string>> expand_text_paths(const std::vector<std::string>& entries);
// Reads expand_text_paths(entries) and splits them. InvalidArgument when the validation split
// would be under 2 KiB (give more text).
absl::StatusOr<TextData> load_text(const std::vector<std::string>& entries);
// The same split of bytes already in memory (tests).
TextData text_from_bytes(const std::string& bytes);

struct Batch {
  at::Tensor inputs, targets;  // int64 [batch_size, context]; targets = inputs shifted by one
};
// Sequences b = 0..batch_size-1 start at sample_offset(seed, stream, step, b, n - context).
// TORCH_CHECK: split (uint8, 1-D) must hold more than context bytes.
Batch sample_batch(const at::Tensor& split, int64_t batch_size, int64_t context, uint64_t seed,
                   uint64_t stream, uint64_t step);

}  // namespace dtrain::bench

#endif  // DTRAIN_BENCH_LM_CHAR_LM_H_
