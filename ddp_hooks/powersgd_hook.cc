#include "ddp_hooks/powersgd_hook.h"

#include <algorithm>
#include <cstddef>
#include <iomanip>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/internal/ordered_worker.h"
#include "ddp_hooks/internal/powersgd_plan.h"

namespace dtrain::ddp_hooks {
namespace {

c10::intrusive_ptr<c10::ivalue::Future> done(const at::Tensor& t) {
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  fut->markCompleted(c10::IValue(t));
  return fut;
}

// LibTorch's CPU kernels lack half-precision bmm (and norms): compute those in fp32 and store
// the result in the tensor's own dtype (the fp16 wrapper hands PowerSGD half buckets).
bool reduced_on_cpu(const at::Tensor& t) {
  return t.device().is_cpu() && (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16);
}

void bmm_into(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (reduced_on_cpu(out)) {
    out.copy_(at::bmm(a.to(at::kFloat), b.to(at::kFloat)));
  } else {
    at::bmm_out(out, a, b);
  }
}

void allreduce(const comm::Group& group, at::Tensor& t) {
  if (t.numel() == 0) return;
  allreduce_sum(group, t)->waitAndThrow();  // float16 on a Gloo that cannot reduce it: gathered
}

// The first use of what load_state_dict brought in for bucket `index`: the checkpoint cannot say
// which model it was written for, so each tensor must fit the bucket (before any collective: a
// misfit fails here, not as a silent re-randomisation or a broadcast add); then it moves to the
// bucket's device.
void adopt_loaded(PowerSGDState& s, int64_t index, bool last, const at::Tensor& input,
                  int64_t ps_size, int64_t qs_size) {
  // The first iteration after loading a state that had compressed: it has every bucket's memories, no other bucket's.
  auto complete = [&](const std::map<int64_t, at::Tensor>& dict, const char* key, bool kept) {
    const bool missing = kept && dict.count(index) == 0,
               extra = last && !dict.empty() && dict.rbegin()->first > index;
    TORCH_CHECK(!missing && !extra, "PowerSGDHook: the loaded state's '", key, "' has ",
                missing ? "no" : "an",
                " entry for "
                "bucket ",
                missing ? index : dict.rbegin()->first,
                missing ? "" : ", which this model does not have",
                "; the "
                "checkpoint was written for another model or bucket layout (bucket_cap_mb), or "
                "edited: resume with the "
                "settings it was written with, or start without its hook state");
  };
  if (s.check_loaded_buckets) {
    complete(s.error_dict, "error_dict", s.use_error_feedback);
    complete(s.p_memory_dict, "p_memory_dict", s.warm_start);
    complete(s.q_memory_dict, "q_memory_dict", s.warm_start);
    s.check_loaded_buckets = !last;
  }
  auto fit = [&](std::map<int64_t, at::Tensor>& dict, const char* key, int64_t numel) {
    auto it = dict.find(index);
    if (it == dict.end()) return;
    const at::Tensor& t = it->second;
    TORCH_CHECK(t.numel() == numel && t.scalar_type() == input.scalar_type(),
                "PowerSGDHook: the loaded state's '", key, "'[", index, "] holds ", t.numel(), " ",
                t.scalar_type(), " numbers but bucket ", index, " needs ", numel, " ",
                input.scalar_type(),
                "; the checkpoint was written for another model, bucket layout "
                "(bucket_cap_mb) or precision: resume with the settings it was written with, or "
                "start without its hook "
                "state");
    it->second = t.to(input.device(), input.scalar_type());
  };
  if (s.unchecked_error_buckets.count(index) > 0) fit(s.error_dict, "error_dict", input.numel());
  if (s.unchecked_memory_buckets.count(index) > 0) {
    fit(s.p_memory_dict, "p_memory_dict", ps_size);
    fit(s.q_memory_dict, "q_memory_dict", qs_size);
  }
  s.unchecked_error_buckets.erase(index);  // checked (a misfit threw above, leaving them unchecked)
  s.unchecked_memory_buckets.erase(index);
}

// PowerSGDHook::run's steps, in the order it takes them (the comments there number them).

// A bucket's gradients as views: the uncompressed ones, and the compressed ones as n x m
// matrices, grouped into the plan's batches.
struct SplitBucket {
  std::vector<at::Tensor> uncompressed;
  std::vector<std::vector<at::Tensor>> batches;
};

internal::PowerSGDPlan plan_of(const std::vector<at::Tensor>& grads, const PowerSGDState& s) {
  std::vector<std::vector<int64_t>> shapes;
  for (const at::Tensor& grad : grads) shapes.push_back(grad.sizes().vec());
  return internal::plan_bucket(shapes, s);
}

SplitBucket split_bucket(const std::vector<at::Tensor>& grads, const internal::PowerSGDPlan& plan) {
  SplitBucket split;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!plan.compressed[i]) split.uncompressed.push_back(grads[i]);
  }
  for (const internal::PowerSGDPlan::Batch& batch : plan.batches) {
    split.batches.emplace_back();
    for (size_t i : batch.members)
      split.batches.back().push_back(grads[i].view({batch.n, batch.m}));
  }
  return split;
}

// Error feedback: adds bucket `index`'s error memory to `input` (a zero memory the first time)
// and returns a copy of the result, from which the next error is taken.
at::Tensor add_error_feedback(PowerSGDState& s, int64_t index, at::Tensor& input) {
  auto it = s.error_dict.find(index);
  if (it != s.error_dict.end()) {
    input.add_(it->second);
  } else {
    s.error_dict[index] = at::zeros_like(input);
  }
  return input.clone();
}

// The uncompressed tensors' concatenation (empty, in `input`'s options, when there are none).
at::Tensor concatenated(const std::vector<at::Tensor>& uncompressed, const at::Tensor& input) {
  std::vector<at::Tensor> flat_parts;
  for (const auto& t : uncompressed) flat_parts.push_back(t.reshape(-1));
  return flat_parts.empty() ? at::empty({0}, input.options()) : at::cat(flat_parts);
}

// Bucket `index`'s P and Q memories, new ones without warm start or when their size changed;
// whether they are new (their Qs are then drawn at random).
bool ensure_memories(PowerSGDState& s, int64_t index, const internal::PowerSGDPlan& plan,
                     const at::Tensor& input) {
  if (!s.warm_start || s.p_memory_dict.count(index) == 0 ||
      s.p_memory_dict[index].numel() != plan.ps_size) {
    s.p_memory_dict[index] = at::empty({plan.ps_size}, input.options());
    s.q_memory_dict[index] = at::empty({plan.qs_size}, input.options());
    return true;
  }
  return false;
}

// Each batch as a b x n x m tensor M, with its Ps (b x n x r) and Qs (b x m x r) as views of
// bucket `index`'s memories.
struct Factors {
  std::vector<at::Tensor> mats, ps, qs;
};

Factors factor_views(PowerSGDState& s, int64_t index,
                     const std::vector<std::vector<at::Tensor>>& batches) {
  Factors f;
  int64_t p_idx = 0, q_idx = 0;
  for (const auto& batch : batches) {
    at::Tensor m = batch.size() == 1 ? batch[0].unsqueeze(0) : at::stack(batch);
    const int64_t b = m.size(0), n = m.size(1), cols = m.size(2);
    const int64_t r = std::min({n, cols, s.matrix_approximation_rank});
    f.mats.push_back(m);
    f.ps.push_back(s.p_memory_dict[index].narrow(0, p_idx, b * n * r).view({b, n, r}));
    f.qs.push_back(s.q_memory_dict[index].narrow(0, q_idx, b * cols * r).view({b, cols, r}));
    p_idx += b * n * r;
    q_idx += b * cols * r;
  }
  return f;
}

// Orthogonalises the Qs, drawing them first when `randomize`.
void prepare_qs(PowerSGDState& s, std::vector<at::Tensor>& qs, bool randomize) {
  if (!randomize) {
    for (auto& q : qs) orthogonalize(q, s.orthogonalization_epsilon);
    return;
  }
  // The same random Qs on every rank: a seeded generator advanced identically everywhere. As
  // PyTorch does, drawn on the CPU in the bucket's dtype and copied to the bucket's device (a
  // CPU generator cannot fill a device tensor, and the numbers stay the same on any device).
  if (!s.rng_seeded) {
    s.rng.seed(s.random_seed);
    s.rng_seeded = true;
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(s.rng() % 1000000000ULL);
  for (auto& q : qs) {
    q.copy_(at::randn(q.sizes(), gen, q.options().device(at::kCPU)));
    orthogonalize(q, s.orthogonalization_epsilon);
  }
}

// All-reduces the uncompressed tensors' concatenation `memory`, averages it and copies it back
// into them.
void average_uncompressed(const comm::Group& group, at::Tensor& memory,
                          std::vector<at::Tensor>& uncompressed) {
  allreduce(group, memory);
  memory.div_(group.size());
  int64_t offset = 0;
  for (auto& t : uncompressed) {
    t.copy_(memory.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

// Decompress: M ~ P Q^T, into the bucket.
void decompress(const Factors& f, std::vector<std::vector<at::Tensor>>& batches) {
  for (size_t k = 0; k < f.mats.size(); ++k) {
    at::Tensor approx = reduced_on_cpu(f.ps[k]) ? at::bmm(f.ps[k].to(at::kFloat),
                                                          f.qs[k].transpose(1, 2).to(at::kFloat))
                                                : at::bmm(f.ps[k], f.qs[k].transpose(1, 2));
    if (batches[k].size() == 1) {
      batches[k][0].copy_(approx[0]);
    } else {
      for (size_t j = 0; j < batches[k].size(); ++j)
        batches[k][j].copy_(approx[static_cast<int64_t>(j)]);
    }
  }
}

}  // namespace

void orthogonalize(at::Tensor& matrices, double epsilon) {
  TORCH_CHECK(matrices.dim() == 3 && matrices.size(2) <= matrices.size(1),
              "orthogonalize expects b x n x r with r <= n");
  if (reduced_on_cpu(matrices)) {
    at::Tensor wide = matrices.to(at::kFloat);
    orthogonalize(wide, epsilon);
    matrices.copy_(wide);
    return;
  }
  const int64_t cols = matrices.size(2);
  for (int64_t i = 0; i < cols; ++i) {
    at::Tensor col = matrices.narrow(2, i, 1);
    at::Tensor norm = at::norm(col, 2, {1}, /*keepdim=*/true);
    if (epsilon == 0) {
      col.div_(norm);
    } else {
      col.div_(norm + epsilon);
    }
    if (i + 1 < cols) {
      at::Tensor rest = matrices.narrow(2, i + 1, cols - i - 1);
      rest.sub_(at::sum(col * rest, {1}, /*keepdim=*/true) * col);
    }
  }
}

void PowerSGDState::validate() const {
  TORCH_CHECK(group.is_member(),
              "PowerSGDState: the process group is not set or this rank is not in it");
  TORCH_CHECK(!((use_error_feedback || warm_start) && start_powerSGD_iter <= 1),
              "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is "
              "enabled, because PowerSGD "
              "can only be applied after the first two iterations in DDP.");
  TORCH_CHECK(matrix_approximation_rank >= 1, "matrix_approximation_rank must be >= 1, got ",
              matrix_approximation_rank);
  TORCH_CHECK(min_compression_rate >= 1, "min_compression_rate must be >= 1, got ",
              min_compression_rate);
}

double PowerSGDState::compression_rate() const {
  return total_numel_after_compression == 0
             ? 1.0
             : static_cast<double>(total_numel_before_compression) / total_numel_after_compression;
}

PowerSGDHook::PowerSGDHook(std::shared_ptr<PowerSGDState> state)
    : StatefulHook(std::move(state), "PowerSGDHook") {
  this->state().validate();
  worker_ = internal::OrderedWorker::for_group(this->state().group);
}

PowerSGDHook::~PowerSGDHook() {
  if (last_) last_->wait();  // no job may outlive the hook
}

c10::intrusive_ptr<c10::ivalue::Future> PowerSGDHook::runHook(c10d::GradBucket& bucket) {
  last_ = worker_->submit([this, bucket]() mutable { return run(bucket); }, bucket.getBufferRef());
  return last_;
}

c10::intrusive_ptr<c10::ivalue::Future> PowerSGDHook::run(c10d::GradBucket& bucket) {
  PowerSGDState& s = state();
  const comm::Group& group = s.group;
  const int world = group.size();
  at::Tensor input = bucket.getBufferRef();
  auto maybe_increase_iter = [&] {
    // The last bucket closes an iteration.
    if (bucket.isLast()) ++s.iter;
  };
  if (s.iter < s.start_powerSGD_iter) {
    input.div_(world);
    allreduce(group, input);
    maybe_increase_iter();
    return done(input);
  }
  c10::NoGradGuard no_grad;
  const int64_t index = static_cast<int64_t>(bucket.getIndex());
  // I. Split into compressed and uncompressed tensors (views of the bucket), the compressed ones
  // in batches (internal/powersgd_plan.h: what check_state_dict checks a loaded state against).
  const std::vector<at::Tensor> grads = bucket.getGradients();
  const internal::PowerSGDPlan plan = plan_of(grads, s);
  SplitBucket split = split_bucket(grads, plan);
  // Before anything changes:
  adopt_loaded(s, index, bucket.isLast(), input, plan.ps_size, plan.qs_size);
  s.total_numel_before_compression += plan.numel;
  s.total_numel_after_compression += plan.numel_after;
  at::Tensor input_copy;
  if (s.use_error_feedback) input_copy = add_error_feedback(s, index, input);
  // II. Uncompressed tensors: one all-reduce of their concatenation.
  at::Tensor uncompressed_memory = concatenated(split.uncompressed, input);
  // III. P and Q memories (reused across iterations with warm start).
  const bool randomize_qs = ensure_memories(s, index, plan, input);
  Factors f = factor_views(s, index, split.batches);
  prepare_qs(s, f.qs, randomize_qs);
  // P = M Q, all-reduced (no division: P is orthogonalised next).
  for (size_t k = 0; k < f.mats.size(); ++k) bmm_into(f.ps[k], f.mats[k], f.qs[k]);
  average_uncompressed(group, uncompressed_memory, split.uncompressed);
  allreduce(group, s.p_memory_dict[index]);
  for (auto& p : f.ps) orthogonalize(p, s.orthogonalization_epsilon);
  // Q = M^T P, all-reduced and averaged.
  for (size_t k = 0; k < f.mats.size(); ++k) bmm_into(f.qs[k], f.mats[k].transpose(1, 2), f.ps[k]);
  allreduce(group, s.q_memory_dict[index]);
  s.q_memory_dict[index].div_(world);
  decompress(f, split.batches);
  if (s.use_error_feedback) s.error_dict[index] = input_copy - input;
  if (!s.warm_start) {
    s.p_memory_dict.clear();
    s.q_memory_dict.clear();
  }
  maybe_increase_iter();
  return done(input);
}

}  // namespace dtrain::ddp_hooks
