#include "ddp_hooks/zero_hook.h"

#include <unordered_map>

#include <ATen/ATen.h>

#include "optim/zero_overlap.h"
#include "partition/bucket_assignment.h"

namespace dtrain::ddp_hooks {

ZeroOverlapHook::ZeroOverlapHook(std::unique_ptr<c10d::CommHookInterface> inner, const DistributedDataParallel& ddp,
                                 optim::ZeroRedundancyOptimizer& zero, bool shard_buckets, ZeroStepSchedule schedule)
    : inner_(std::move(inner)), zero_(zero), schedule_(schedule) {
  TORCH_CHECK(inner_ != nullptr, "hook_with_zero_step needs the hook that reduces the gradients (e.g. AllReduceHook)");
  TORCH_CHECK(zero.overlap_with_ddp(), "hook_with_zero_step needs a ZeroRedundancyOptimizer built with "
              "ZeroOptions::overlap_with_ddp = true");
  const auto& zero_params = zero.parameters();
  std::unordered_map<const c10::TensorImpl*, int64_t> zero_index;
  for (size_t i = 0; i < zero_params.size(); ++i) zero_index[zero_params[i].unsafeGetTensorImpl()] = static_cast<int64_t>(i);
  const auto& ddp_params = ddp.parameters();
  std::vector<bool> covered(zero_params.size(), false);
  std::vector<std::vector<int64_t>> numels;
  for (const auto& bucket : ddp.bucket_indices()) {
    bucket_params_.emplace_back();
    numels.emplace_back();
    for (size_t d : bucket) {
      auto it = zero_index.find(ddp_params[d].unsafeGetTensorImpl());
      TORCH_CHECK(it != zero_index.end(), "hook_with_zero_step: DDP parameter '", ddp.parameter_names()[d],
                  "' is not a parameter of the ZeroRedundancyOptimizer; build it over the same parameters as DDP");
      covered[it->second] = true;
      bucket_params_.back().push_back(it->second);
      numels.back().push_back(ddp_params[d].numel());
    }
  }
  for (size_t i = 0; i < covered.size(); ++i) {
    TORCH_CHECK(covered[i], "hook_with_zero_step: ZeroRedundancyOptimizer parameter ", i,
                " is not reduced by DDP (frozen, or from another module); build ZeRO over DDP's parameters only");
  }
  absl::StatusOr<partition::BucketPartition> bp = partition::assign_ddp_buckets(numels, zero.world_size(), shard_buckets);
  TORCH_CHECK(bp.ok(), "hook_with_zero_step: ", bp.status().message());
  // Owners' parameters in bucket order, so a bucket's slice is contiguous in its owner's ZeRO
  // bucket view and goes out as one broadcast.
  std::vector<std::vector<int64_t>> params_per_rank(zero.world_size());
  for (size_t b = 0; b < bucket_params_.size(); ++b) {
    for (int r = 0; r < zero.world_size(); ++r) {
      auto it = bp->per_rank[r].find(static_cast<int64_t>(b));
      if (it == bp->per_rank[r].end()) continue;
      for (int64_t k = 0; k < it->second.num_params; ++k) {
        params_per_rank[r].push_back(bucket_params_[b][it->second.param_offset + k]);
      }
    }
  }
  optim::ZeroOverlap(zero).set_partition(std::move(params_per_rank));
  pending_.resize(bucket_params_.size());
}

c10::intrusive_ptr<c10::ivalue::Future> ZeroOverlapHook::runHook(c10d::GradBucket& bucket) {
  const size_t b = bucket.getIndex();
  TORCH_CHECK(b == expected_ && b < pending_.size(), "ZeRO overlap hook: expected bucket ", expected_, " of ",
              pending_.size(), " but DDP reduced bucket ", b, "; register the hook on the DDP it was built for");
  pending_[b].future = inner_->runHook(bucket);
  pending_[b].layout = bucket.getGradients();
  pending_[b].buffer = bucket.getBuffer();
  // Every rank issues the collectives in the same order (interleaved: all-reduce b, broadcast
  // b-1; after backward: every all-reduce, then every broadcast), so they pair up.
  if (schedule_ == ZeroStepSchedule::kInterleaved && b > 0) {
    // Bucket b-1's reduction ran while bucket b's gradients were computed: step it now, so its
    // broadcast overlaps with the rest of backward.
    step_bucket(b - 1);
  }
  ++expected_;
  if (bucket.isLast()) {
    const size_t first = schedule_ == ZeroStepSchedule::kInterleaved ? b : 0;
    for (size_t k = first; k <= b; ++k) step_bucket(k);
    for (auto& w : broadcasts_) w->wait();
    broadcasts_.clear();
    expected_ = 0;
  }
  return pending_[b].future;
}

void ZeroOverlapHook::step_bucket(size_t b) {
  Pending& p = pending_[b];
  p.future->wait();
  at::Tensor result = inner_->parseHookResult(p.future->value());
  std::vector<at::Tensor> grads;
  grads.reserve(p.layout.size());
  if (result.is_same(p.buffer)) {
    grads = p.layout;
  } else {
    // The hook returned a new tensor: the same layout over it.
    int64_t offset = 0;
    for (const at::Tensor& g : p.layout) {
      grads.push_back(result.narrow(0, offset, g.numel()).view(g.sizes()));
      offset += g.numel();
    }
  }
  optim::ZeroOverlap overlap(zero_);
  overlap.step(bucket_params_[b], grads);
  for (auto& w : overlap.broadcast(bucket_params_[b])) broadcasts_.push_back(std::move(w));
  p.layout.clear();
  p.buffer = at::Tensor();
}

at::Tensor ZeroOverlapHook::parseHookResult(const c10::IValue& result) { return inner_->parseHookResult(result); }

std::string ZeroOverlapHook::why_not_joinable() const {
  return "the ZeRO overlap hook steps the optimizer inside the gradient reduction, and a joined rank's shadow "
         "reductions would step it with zero gradients (PyTorch's hook does that silently); give every rank the same "
         "number of inputs, or use ZeroRedundancyOptimizer without overlap_with_ddp inside the Join";
}

std::unique_ptr<c10d::CommHookInterface> hook_with_zero_step(std::unique_ptr<c10d::CommHookInterface> inner,
                                                             const DistributedDataParallel& ddp,
                                                             optim::ZeroRedundancyOptimizer& zero,
                                                             bool shard_buckets) {
  return std::make_unique<ZeroOverlapHook>(std::move(inner), ddp, zero, shard_buckets,
                                           ZeroStepSchedule::kAfterBackward);
}

std::unique_ptr<c10d::CommHookInterface> hook_with_zero_step_interleaved(
    std::unique_ptr<c10d::CommHookInterface> inner, const DistributedDataParallel& ddp,
    optim::ZeroRedundancyOptimizer& zero, bool shard_buckets) {
  return std::make_unique<ZeroOverlapHook>(std::move(inner), ddp, zero, shard_buckets,
                                           ZeroStepSchedule::kInterleaved);
}

}  // namespace dtrain::ddp_hooks
