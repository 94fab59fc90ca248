#include "optim/zero_overlap.h"

#include <c10/core/GradMode.h>

#include "optim/internal/zero_layout.h"

namespace dtrain::optim {

internal::WholeParamLayout& ZeroOverlap::layout() {
  auto* whole = dynamic_cast<internal::WholeParamLayout*>(zero_.layout_.get());
  TORCH_CHECK(zero_.options_.overlap_with_ddp && whole != nullptr,
              "the ZeRO overlap API is for overlap_with_ddp: "
              "set ZeroOptions::overlap_with_ddp = true (whole parameters, kSortedGreedy)");
  return *whole;
}

void ZeroOverlap::set_partition(std::vector<std::vector<int64_t>> params_per_rank) {
  TORCH_CHECK(zero_.options_.overlap_with_ddp,
              "set_overlap_partition is for overlap_with_ddp: set "
              "ZeroOptions::overlap_with_ddp = true");
  TORCH_CHECK(!zero_.stepped_ && !zero_.state_loaded_,
              "the ZeRO overlap hook must be registered before the first "
              "step and before loading a checkpoint: the optimizer already holds state for the old "
              "partition");
  zero_.options_.params_per_rank = std::move(params_per_rank);
  zero_.build_layout();
  zero_.build_local_optimizer();
  zero_.consolidated_ = c10::IValue();
}

void ZeroOverlap::step(const std::vector<int64_t>& params, const std::vector<at::Tensor>& grads) {
  TORCH_CHECK(params.size() == grads.size(), "overlap_step: ", params.size(), " parameters but ",
              grads.size(), " gradients");
  const internal::WholeParamLayout& whole = layout();
  TORCH_CHECK(
      !whole.trainability_changed(),
      "ZeroRedundancyOptimizer with overlap_with_ddp does not support "
      "changing parameter trainability at run time: a parameter's requires_grad changed after the "
      "ZeRO "
      "overlap hook was registered; build DDP, the optimizer and the hook again over the new set");
  auto& adapter = dynamic_cast<FunctionalOptimizerAdapter&>(*zero_.local_);
  std::vector<at::Tensor> local_grads;
  bool any = false;
  for (size_t k = 0; k < params.size(); ++k) {
    const int64_t i = params[k];
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(whole.params().size()),
                "overlap_step: parameter index ", i, " out of range");
    const int64_t local = whole.local_index(i);
    if (local < 0) continue;
    if (local_grads.empty()) local_grads.resize(whole.entries().size());
    local_grads[static_cast<size_t>(local)] = grads[k];
    any = true;
  }
  if (!any) return;
  zero_.sync_options(/*to_local=*/true);
  c10::NoGradGuard no_grad;
  adapter.functional(0).step(local_grads);
  zero_.stepped_ = true;
  zero_.stale_consolidation_ = zero_.stale_consolidation_ || !zero_.consolidated_.isNone();
  zero_.consolidated_ = c10::IValue();
}

std::vector<c10::intrusive_ptr<c10d::Work>> ZeroOverlap::broadcast(
    const std::vector<int64_t>& params) {
  internal::Works works;
  layout().broadcast(params, works);
  return works;
}

}  // namespace dtrain::optim

namespace dtrain::optim {

ZeroGradShards::ZeroGradShards(ZeroRedundancyOptimizer& zero) : zero_(zero) {
  TORCH_CHECK(zero_.options_.shard_gradients,
              "the ZeRO-2 hook needs a ZeroRedundancyOptimizer built with "
              "ZeroOptions::shard_gradients = true");
}

internal::GradShardLayout& ZeroGradShards::layout() const {
  auto* shards = dynamic_cast<internal::GradShardLayout*>(zero_.layout_.get());
  TORCH_CHECK(shards != nullptr, "ZeroGradShards: set_buckets has not been called");
  return *shards;
}

void ZeroGradShards::set_buckets(std::vector<std::vector<int64_t>> bucket_params) {
  TORCH_CHECK(!zero_.stepped_ && !zero_.state_loaded_,
              "the ZeRO-2 hook must be registered before the "
              "first step and before loading a checkpoint: the optimizer already holds state for "
              "the old layout");
  TORCH_CHECK(!bucket_params.empty(), "ZeroGradShards::set_buckets: no buckets");
  zero_.grad_shard_buckets_ = std::move(bucket_params);
  zero_.build_layout();
  zero_.build_local_optimizer();
  zero_.consolidated_ = c10::IValue();
}

int64_t ZeroGradShards::bucket_numel(size_t b) const { return layout().bucket_numel(b); }
int64_t ZeroGradShards::padded_numel(size_t b) const { return layout().padded_numel(b); }
at::Tensor ZeroGradShards::grad_chunk(size_t b) const { return layout().grad_chunk(b); }
void ZeroGradShards::mark_reduced() { layout().mark_reduced(); }

}  // namespace dtrain::optim
