#include "bench/lm/char_lm.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>
#include <system_error>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional.h>
#include <torch/torch.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/state_file.h"

namespace dtrain::bench {
namespace {

namespace F = torch::nn::functional;

// The validation split is the last n / kValDivisor bytes.
constexpr int64_t kValDivisor = 10;
constexpr int64_t kMinValBytes = 2048;

}  // namespace

void CharLMOptions::check() const {
  TORCH_CHECK(
      vocab_size > 0 && d_model > 0 && n_layers > 0 && n_heads > 0 && context > 0 && mlp_ratio > 0,
      "CharLMOptions: every size must be positive (vocab_size ", vocab_size, ", d_model ", d_model,
      ", n_layers ", n_layers, ", n_heads ", n_heads, ", context ", context, ", mlp_ratio ",
      mlp_ratio, ")");
  TORCH_CHECK(d_model % n_heads == 0, "CharLMOptions: d_model (", d_model,
              ") must be a multiple of n_heads (", n_heads, "); change one of them");
  TORCH_CHECK(std::isfinite(init_std) && init_std >= 0,
              "CharLMOptions: init_std must be finite "
              "and non-negative, got ",
              init_std);
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(int64_t d_model, int64_t n_heads)
    : n_heads_(n_heads) {
  qkv_ = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
  proj_ = register_module("proj", torch::nn::Linear(d_model, d_model));
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), c = x.size(2), hd = c / n_heads_;
  const std::vector<at::Tensor> qkv = qkv_->forward(x).split(c, 2);
  const at::Tensor q = qkv[0].view({b, t, n_heads_, hd}).transpose(1, 2);  // [B, H, T, hd]
  const at::Tensor k = qkv[1].view({b, t, n_heads_, hd}).transpose(1, 2);
  const at::Tensor v = qkv[2].view({b, t, n_heads_, hd}).transpose(1, 2);
  at::Tensor att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
  const at::Tensor future = torch::ones({t, t}, torch::dtype(torch::kBool)).triu(1);
  att = torch::softmax(att.masked_fill(future, -std::numeric_limits<double>::infinity()), -1);
  const at::Tensor y = torch::matmul(att, v).transpose(1, 2).contiguous().view({b, t, c});
  return proj_->forward(y);
}

MlpImpl::MlpImpl(int64_t d_model, int64_t hidden) {
  fc_ = register_module("fc", torch::nn::Linear(d_model, hidden));
  proj_ = register_module("proj", torch::nn::Linear(hidden, d_model));
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  return proj_->forward(F::gelu(fc_->forward(x)));
}

BlockImpl::BlockImpl(int64_t d_model, int64_t n_heads, int64_t mlp_hidden) {
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  attn_ = register_module("attn", CausalSelfAttention(d_model, n_heads));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  mlp_ = register_module("mlp", Mlp(d_model, mlp_hidden));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  const at::Tensor h = x + attn_->forward(ln1_->forward(x));
  return h + mlp_->forward(ln2_->forward(h));
}

CharLMImpl::CharLMImpl(const CharLMOptions& options) : options_(options) {
  options_.check();
  const int64_t d = options_.d_model;
  tok_emb_ = register_module("tok_emb", torch::nn::Embedding(options_.vocab_size, d));
  pos_emb_ = register_module("pos_emb", torch::nn::Embedding(options_.context, d));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < options_.n_layers; ++i) {
    blocks_->push_back(Block(d, options_.n_heads, options_.mlp_ratio * d));
  }
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  head_ = register_module(
      "head", torch::nn::Linear(torch::nn::LinearOptions(d, options_.vocab_size).bias(false)));
  reset_parameters(options_.seed);
}

at::Tensor CharLMImpl::forward(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong,
              "CharLM: tokens must be an int64 [batch, time] tensor, got ", tokens.scalar_type(),
              " of shape ", tokens.sizes());
  const int64_t t = tokens.size(1);
  TORCH_CHECK(t >= 1 && t <= options_.context, "CharLM: sequence length ", t,
              " must be in [1, context = ", options_.context, "]; cut it or raise context");
  const at::Tensor pos = torch::arange(t, torch::dtype(torch::kLong).device(tokens.device()));
  at::Tensor x = tok_emb_->forward(tokens) + pos_emb_->forward(pos);
  for (const auto& block : *blocks_) x = block->as<Block>()->forward(x);
  return head_->forward(ln_f_->forward(x));
}

at::Tensor CharLMImpl::loss(const at::Tensor& inputs, const at::Tensor& targets) {
  TORCH_CHECK(targets.sizes() == inputs.sizes(), "CharLM::loss: targets ", targets.sizes(),
              " must have the shape of inputs ", inputs.sizes());
  // In float32 whatever the model's dtype (a bfloat16 model's logits widened, as autocast does):
  // the loss of a bfloat16 model is not rounded to bfloat16's 8 bits.
  const at::Tensor logits = forward(inputs).to(at::kFloat);
  return F::cross_entropy(logits.reshape({-1, options_.vocab_size}), targets.reshape({-1}));
}

void CharLMImpl::reset_parameters(uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double residual_std = options_.init_std / std::sqrt(2.0 * double(options_.n_layers));
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& p = item.value();
    // The module's own name: "ln1" in "blocks.0.ln1.weight", "ln_f" in "ln_f.weight".
    const std::string module = name.substr(0, name.rfind('.'));
    const bool layer_norm = absl::StartsWith(module.substr(module.rfind('.') + 1), "ln");
    if (absl::EndsWith(name, ".bias")) {
      p.zero_();
    } else if (layer_norm) {
      p.fill_(1.0);
    } else if (absl::EndsWith(name, "attn.proj.weight") ||
               absl::EndsWith(name, "mlp.proj.weight")) {
      p.normal_(0.0, residual_std, gen);
    } else {
      p.normal_(0.0, options_.init_std, gen);
    }
  }
}

int64_t CharLMImpl::parameter_count() const {
  int64_t n = 0;
  for (const at::Tensor& p : parameters()) n += p.numel();
  return n;
}

absl::Status save_weights(CharLM& model, const std::string& path) {
  c10::Dict<std::string, at::Tensor> weights;
  for (const auto& item : model->named_parameters()) {
    weights.insert(item.key(), item.value().detach().contiguous());
  }
  return checkpoint::save_state(path, c10::IValue(weights));
}

absl::Status load_weights(CharLM& model, const std::string& path) {
  absl::StatusOr<c10::IValue> loaded = checkpoint::load_state(path);
  if (!loaded.ok()) return loaded.status();
  if (!loaded->isGenericDict()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        ": expected a dict of parameter name -> tensor (save_weights or torch.save of a "
        "state_dict), got ",
        loaded->tagKind()));
  }
  const c10::impl::GenericDict dict = loaded->toGenericDict();
  auto params = model->named_parameters();
  for (const auto& entry : dict) {
    if (!entry.key().isString() || params.find(entry.key().toStringRef()) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": unexpected entry ", entry.key().isString() ? entry.key().toStringRef() : "?",
          " (was it written for another model? check the size flags)"));
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& item : params) {
    const std::string& name = item.key();
    if (!dict.contains(name) || !dict.at(name).isTensor()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": no tensor for parameter ", name));
    }
    const at::Tensor t = dict.at(name).toTensor();
    if (t.sizes() != item.value().sizes() || t.scalar_type() != item.value().scalar_type()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": parameter ", name, " is ", c10::toString(t.scalar_type()), " ",
          c10::str(t.sizes()), " but the model's is ", c10::toString(item.value().scalar_type()),
          " ", c10::str(item.value().sizes()), " (check the size flags)"));
    }
    item.value().copy_(t);
  }
  return absl::OkStatus();
}

uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

uint64_t sample_offset(uint64_t seed, uint64_t stream, uint64_t step, uint64_t index,
                       uint64_t count) {
  TORCH_CHECK(count > 0, "sample_offset: count must be positive");
  uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ stream);
  h = splitmix64(h ^ step);
  h = splitmix64(h ^ index);
  return h % count;
}

absl::StatusOr<std::vector<std::string>> expand_text_paths(
    const std::vector<std::string>& entries) {
  namespace fs = std::filesystem;
  std::set<std::string> files;  // sorted by bytes: Python's sorted() order for UTF-8 paths
  for (const std::string& entry : entries) {
    std::error_code ec;
    const fs::file_status st = fs::status(entry, ec);
    if (ec || !fs::exists(st)) {
      return absl::NotFoundError(absl::StrCat("text file or directory ", entry, " not found"));
    }
    if (!fs::is_directory(st)) {
      files.insert(entry);
      continue;
    }
    for (auto it = fs::recursive_directory_iterator(entry, ec); !ec && it != fs::end(it);
         it.increment(ec)) {
      if (it->is_regular_file() && !it->is_symlink()) files.insert(it->path().string());
    }
    if (ec) return absl::UnavailableError(absl::StrCat("reading ", entry, ": ", ec.message()));
  }
  if (files.empty()) {
    return absl::InvalidArgumentError("no text files: give --text=FILE[,FILE or DIRECTORY...]");
  }
  return std::vector<std::string>(files.begin(), files.end());
}

TextData text_from_bytes(const std::string& bytes) {
  TextData d;
  d.total_bytes = static_cast<int64_t>(bytes.size());
  const int64_t n_val = d.total_bytes / kValDivisor;
  at::Tensor all = torch::empty({d.total_bytes}, torch::kUInt8);
  std::copy(bytes.begin(), bytes.end(), reinterpret_cast<char*>(all.data_ptr<uint8_t>()));
  d.train = all.slice(0, 0, d.total_bytes - n_val);
  d.val = all.slice(0, d.total_bytes - n_val);
  return d;
}

absl::StatusOr<TextData> load_text(const std::vector<std::string>& entries) {
  absl::StatusOr<std::vector<std::string>> files = expand_text_paths(entries);
  if (!files.ok()) return files.status();
  std::string bytes;
  for (const std::string& f : *files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) return absl::UnavailableError(absl::StrCat("cannot read text file ", f));
    bytes.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  if (static_cast<int64_t>(bytes.size()) / kValDivisor < kMinValBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the text files hold ", bytes.size(), " bytes; at least ", kMinValBytes * kValDivisor,
        " are needed (the last 10% is the validation split): give more --text"));
  }
  TextData d = text_from_bytes(bytes);
  d.files = *std::move(files);
  return d;
}

Batch sample_batch(const at::Tensor& split, int64_t batch_size, int64_t context, uint64_t seed,
                   uint64_t stream, uint64_t step) {
  TORCH_CHECK(split.dim() == 1 && split.scalar_type() == torch::kUInt8,
              "sample_batch: split must be a 1-D uint8 tensor of bytes");
  TORCH_CHECK(batch_size > 0 && context > 0, "sample_batch: batch_size (", batch_size,
              ") and context (", context, ") must be positive");
  const int64_t n = split.size(0);
  TORCH_CHECK(n > context, "sample_batch: the split holds ", n, " bytes, not more than context ",
              context, "; give more text or a shorter context");
  std::vector<int64_t> starts(batch_size);
  for (int64_t b = 0; b < batch_size; ++b) {
    starts[b] = static_cast<int64_t>(sample_offset(seed, stream, step, static_cast<uint64_t>(b),
                                                   static_cast<uint64_t>(n - context)));
  }
  const at::Tensor idx = torch::tensor(starts, torch::kLong).unsqueeze(1) +
                         torch::arange(context + 1, torch::kLong).unsqueeze(0);
  const at::Tensor chunk = split.index({idx}).to(torch::kLong);  // [B, context + 1]
  return Batch{chunk.slice(1, 0, context), chunk.slice(1, 1, context + 1)};
}

}  // namespace dtrain::bench
