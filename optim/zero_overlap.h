// ZeroRedundancyOptimizer's side of PyTorch's overlap_with_ddp, for ddp_hooks' ZeRO overlap hook
// (ddp_hooks/zero_hook.h) only: Bazel visibility keeps every other package out. The hook calls
// these identically on every rank; the optimizer must be built with ZeroOptions::overlap_with_ddp
// (whole parameters, a functional local optimizer, one parameter group).
//
//   dtrain::optim::ZeroOverlap overlap(zero);
//   overlap.set_partition(params_per_rank_from_ddp_buckets);      // before the first step
//   // per DDP bucket, once its gradients are averaged:
//   overlap.step(bucket_params, bucket_grads);
//   for (auto& w : overlap.broadcast(bucket_params)) pending.push_back(w);   // wait before the next forward
//
// And the side of ZeroOptions::shard_gradients (ZeRO-2) for ddp_hooks' hook_with_zero2:
//
//   dtrain::optim::ZeroGradShards shards(zero);
//   shards.set_buckets(bucket_params);                  // before the first step
//   // per DDP bucket b: reduce-scatter its gradients (padded to shards.padded_numel(b)) into
//   // shards.grad_chunk(b); at the end of backward, once all are done:
//   shards.mark_reduced();
#ifndef DTRAIN_OPTIM_ZERO_OVERLAP_H_
#define DTRAIN_OPTIM_ZERO_OVERLAP_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "comm/process_group.h"
#include "optim/zero_redundancy_optimizer.h"

namespace dtrain::optim {

namespace internal {
class GradShardLayout;
class WholeParamLayout;
}  // namespace internal

class ZeroOverlap {
 public:
  // `zero` must outlive this object.
  explicit ZeroOverlap(ZeroRedundancyOptimizer& zero) : zero_(zero) {}

  // Collective: re-partitions the optimizer's single group into whole parameters per rank
  // (indices into it), e.g. derived from the DDP buckets, and rebuilds the local optimizer and the
  // bucket views. Errors (c10::Error): not built with overlap_with_ddp; a step already taken (the
  // state belongs to the old partition); an invalid partition.
  void set_partition(std::vector<std::vector<int64_t>> params_per_rank);
  // Steps the parameters among `params` that this rank owns with `grads` (the averaged
  // gradients, one per parameter). Not collective. Errors: size mismatch, an index out of range,
  // a parameter's requires_grad changed since set_partition (as PyTorch raises).
  void step(const std::vector<int64_t>& params, const std::vector<at::Tensor>& grads);
  // Collective, in call order on every rank: starts the broadcasts of `params` from their owners
  // (one tensor per run of parameters adjacent in the owner's bucket view). The caller waits on
  // the returned works.
  std::vector<c10::intrusive_ptr<c10d::Work>> broadcast(const std::vector<int64_t>& params);

 private:
  internal::WholeParamLayout& layout();

  ZeroRedundancyOptimizer& zero_;
};

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

#endif  // DTRAIN_OPTIM_ZERO_OVERLAP_H_
