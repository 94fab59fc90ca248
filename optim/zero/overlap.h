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
// ZeRO-2's side (ZeroOptions::shard_gradients) is optim/zero/grad_shards.h.
#ifndef DTRAIN_OPTIM_ZERO_OVERLAP_H_
#define DTRAIN_OPTIM_ZERO_OVERLAP_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "comm/process_group.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::optim {

namespace internal {
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

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_ZERO_OVERLAP_H_
