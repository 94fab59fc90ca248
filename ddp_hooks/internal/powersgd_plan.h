// How the PowerSGD hook splits one bucket (private to ddp_hooks:powersgd_hook): which gradients it
// compresses, how it batches them and where each batch's P and Q live in the bucket's flat P and
// Q memories. One function, used by the hook at every compressed step and by
// PowerSGDState::check_state_dict to check a loaded state against the model's buckets, so that
// both agree on every length; and that check (check_memories, in powersgd_buckets.cc).
//
//   const PowerSGDPlan plan = plan_bucket(shapes, state);
//   plan.ps_size, plan.qs_size;       // the lengths of p_memory_dict[b] and q_memory_dict[b]
//   for (const auto& batch : plan.batches) ...   // batch.members: indices into `shapes`
#ifndef DTRAIN_DDP_HOOKS_INTERNAL_POWERSGD_PLAN_H_
#define DTRAIN_DDP_HOOKS_INTERNAL_POWERSGD_PLAN_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/status/status.h"
#include "ddp_hooks/powersgd_hook.h"

namespace dtrain::ddp_hooks::internal {

struct PowerSGDPlan {
  // Matrices of one shape (n x m, approximated at rank r), stacked into a b x n x m batch: one
  // member without batch_tensors_with_same_shape. Its Ps are b * n * r numbers of the P memory,
  // its Qs b * m * r numbers of the Q memory, after the batches before it.
  struct Batch {
    std::vector<size_t> members;  // indices into the bucket's gradients
    int64_t n = 0, m = 0, r = 0;
  };
  std::vector<bool> compressed;  // per gradient, in bucket order
  std::vector<Batch> batches;    // in the order of their P and Q memories
  int64_t numel = 0;             // the bucket's length (the error memory's)
  int64_t numel_after = 0;       // numbers sent: (n + m) r per compressed matrix, numel otherwise
  int64_t ps_size = 0, qs_size = 0;
};

// Each gradient is an n x m matrix (n its first dimension, 1 for a scalar); it is compressed when
// it has >= 2 dimensions and (n + m) r * min_compression_rate < n m, r = min(n, m, rank).
inline PowerSGDPlan plan_bucket(const std::vector<std::vector<int64_t>>& shapes,
                                const PowerSGDState& s) {
  PowerSGDPlan plan;
  std::map<std::pair<int64_t, int64_t>, size_t> by_shape;  // (n, m) -> batch
  for (size_t i = 0; i < shapes.size(); ++i) {
    int64_t numel = 1;
    for (int64_t d : shapes[i]) numel *= d;
    const int64_t n = shapes[i].empty() ? 1 : shapes[i][0];
    const int64_t m = numel / std::max<int64_t>(n, 1);
    const int64_t r = std::min({n, m, s.matrix_approximation_rank});
    const int64_t after = (n + m) * r;
    const bool compress =
        shapes[i].size() >= 2 &&
        static_cast<double>(after) * s.min_compression_rate < static_cast<double>(numel);
    plan.numel += numel;
    plan.numel_after += compress ? after : numel;
    plan.compressed.push_back(compress);
    if (!compress) continue;
    plan.ps_size += n * r;
    plan.qs_size += m * r;
    auto it = by_shape.find({n, m});
    if (!s.batch_tensors_with_same_shape || it == by_shape.end()) {
      plan.batches.push_back({{}, n, m, r});
      it = by_shape.insert_or_assign({n, m}, plan.batches.size() - 1).first;
    }
    plan.batches[it->second].members.push_back(i);
  }
  return plan;
}

// The memories of a state at iteration `iter` against the model's `buckets`: each for a bucket
// the model has, of its dtype and length; for every bucket once the state has compressed (iter >
// start_powerSGD_iter); with orthogonalization_epsilon 0, Qs that orthogonalise (no column of
// zeros). DataLoss naming the key and the bucket (without the "PowerSGD state" prefix).
absl::Status check_memories(const PowerSGDState& s, int64_t iter,
                            const std::map<int64_t, at::Tensor>& error,
                            const std::map<int64_t, at::Tensor>& p_memory,
                            const std::map<int64_t, at::Tensor>& q_memory,
                            const std::vector<PowerSGDBucket>& buckets);

}  // namespace dtrain::ddp_hooks::internal

#endif  // DTRAIN_DDP_HOOKS_INTERNAL_POWERSGD_PLAN_H_
