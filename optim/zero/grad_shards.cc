#include "optim/zero/grad_shards.h"

#include "optim/zero/internal/access.h"
#include "optim/zero/internal/layout.h"

namespace dtrain::optim {

using internal::ZeroAccess;

ZeroGradShards::ZeroGradShards(ZeroRedundancyOptimizer& zero) : zero_(zero) {
  TORCH_CHECK(ZeroAccess::options(zero_).shard_gradients,
              "the ZeRO-2 hook needs a ZeroRedundancyOptimizer built with "
              "ZeroOptions::shard_gradients = true");
}

internal::GradShardLayout& ZeroGradShards::layout() const {
  auto* shards = dynamic_cast<internal::GradShardLayout*>(ZeroAccess::layout(zero_));
  TORCH_CHECK(shards != nullptr, "ZeroGradShards: set_buckets has not been called");
  return *shards;
}

void ZeroGradShards::set_buckets(std::vector<std::vector<int64_t>> bucket_params) {
  TORCH_CHECK(!ZeroAccess::has_state(zero_),
              "the ZeRO-2 hook must be registered before the "
              "first step and before loading a checkpoint: the optimizer already holds state for "
              "the old layout");
  TORCH_CHECK(!bucket_params.empty(), "ZeroGradShards::set_buckets: no buckets");
  ZeroAccess::set_grad_shard_buckets(zero_, std::move(bucket_params));
  ZeroAccess::relayout(zero_);
}

int64_t ZeroGradShards::bucket_numel(size_t b) const { return layout().bucket_numel(b); }
int64_t ZeroGradShards::padded_numel(size_t b) const { return layout().padded_numel(b); }
at::Tensor ZeroGradShards::grad_chunk(size_t b) const { return layout().grad_chunk(b); }
void ZeroGradShards::mark_reduced() { layout().mark_reduced(); }

}  // namespace dtrain::optim
