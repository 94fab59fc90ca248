// ZeRO-2 (ZeroOptions::shard_gradients): ZeroRedundancyOptimizer's side of ddp_hooks'
// hook_with_zero2 (ddp_hooks/zero_hook.h), visible to ddp_hooks only. One iteration:
//
//   1. registration: hook_with_zero2 passes DDP's buckets (global parameter indices) to
//      set_buckets(), which lays them out as a GradShardLayout (internal/layout.h): per
//      bucket a flat range padded to world x chunk; this rank owns chunk `rank` of every bucket,
//      and the local optimizer is rebuilt over those chunks.
//   2. backward, per bucket b (ddp_hooks/zero_hook.cc): the bucket's gradients, padded to
//      padded_numel(b), are reduce-scattered into grad_chunk(b); .grad stays empty and the
//      bucket is freed.
//   3. end of backward, once every reduce-scatter is done: mark_reduced().
//   4. zero.step(): the local optimizer steps this rank's chunks, then each bucket's parameters
//      are all-gathered from their owners (zero_redundancy_optimizer.h).
//
//   dtrain::optim::ZeroGradShards shards(zero);
//   shards.set_buckets(bucket_params);                  // before the first step
//   // per DDP bucket b: reduce-scatter its gradients (padded to shards.padded_numel(b)) into
//   // shards.grad_chunk(b); at the end of backward, once all are done:
//   shards.mark_reduced();
#ifndef DTRAIN_OPTIM_ZERO_GRAD_SHARDS_H_
#define DTRAIN_OPTIM_ZERO_GRAD_SHARDS_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::optim {

namespace internal {
class GradShardLayout;
}  // namespace internal

class ZeroGradShards {
 public:
  // `zero` must outlive this object. Errors (c10::Error): not built with shard_gradients.
  explicit ZeroGradShards(ZeroRedundancyOptimizer& zero);

  // Lays the parameters out by DDP bucket (global indices per bucket, reduction order) and
  // rebuilds the local optimizer over this rank's ranges. Not collective, but every rank must
  // pass the same buckets. Errors: a step already taken or state already loaded (it belongs to
  // the old layout); buckets that do not cover every parameter exactly once.
  void set_buckets(std::vector<std::vector<int64_t>> bucket_params);
  // REQUIRES set_buckets. Bucket b: its gradient elements, padded to world * chunk, and this
  // rank's chunk of the reduced gradient (where the reduce-scatter writes the average).
  int64_t bucket_numel(size_t b) const;
  int64_t padded_numel(size_t b) const;
  at::Tensor grad_chunk(size_t b) const;
  // Every bucket of a backward pass has been reduced: step() uses the chunks from now on.
  void mark_reduced();

 private:
  internal::GradShardLayout& layout() const;

  ZeroRedundancyOptimizer& zero_;
};

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_ZERO_GRAD_SHARDS_H_
