// PyTorch's hook_with_zero_step and hook_with_zero_step_interleaved: ZeroRedundancyOptimizer's
// step inside DDP's communication hook. The ranks owning a bucket's parameters step them with the
// averaged gradients and broadcast them while other communication is still in flight; by the end
// of backward every parameter is updated and synchronised, and zero.step() has nothing left to do.
// The two schedules (PyTorch's documented behaviour):
// - hook_with_zero_step: backward computes every gradient without interruption; the steps start
//   once the last bucket is handed to the hook, bucket by bucket, each after its all-reduce,
//   overlapping with the all-reduces still running and with the broadcasts. Better when
//   communication is slow compared to computation.
// - hook_with_zero_step_interleaved: bucket b's step runs when bucket b+1 is handed to the hook,
//   so optimizer computation interleaves with backward computation and each broadcast starts
//   during backward.
//
//   dtrain::ddp_hooks::DistributedDataParallel ddp(model, ddp_options);
//   dtrain::optim::ZeroOptions zo;
//   zo.group = world;
//   zo.overlap_with_ddp = true;
//   dtrain::optim::ZeroRedundancyOptimizer zero(
//       model->parameters(), dtrain::optim::local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)), zo);
//   ddp.register_comm_hook(dtrain::ddp_hooks::hook_with_zero_step(
//       std::make_unique<dtrain::ddp_hooks::AllReduceHook>(world), ddp, zero));
//   for (...) { zero.zero_grad(); ddp.forward(...).backward(); }   // no zero.step() needed
//
// The ZeRO parameters must be exactly DDP's parameters (one group); a torch::optim optimizer with
// a functional twin is converted to it. Parameters are re-partitioned by DDP bucket (whole buckets
// round-robin, or slices of buckets with shard_buckets, PyTorch's assignment), so register the
// hook before the first step. Unlike PyTorch, the first iterations are not spent on warm-up: every
// iteration updates the model, and Gloo is supported (PyTorch requires NCCL or HCCL, because its
// callbacks may issue collectives in different orders on different ranks; here every collective
// is issued from the hook, in the same order everywhere). Not for use inside a Join: a joined
// rank would step with zero gradients; DistributedDataParallel::join refuses it.
#ifndef DTRAIN_DDP_HOOKS_ZERO_HOOK_H_
#define DTRAIN_DDP_HOOKS_ZERO_HOOK_H_

#include <memory>
#include <vector>

#include <torch/csrc/distributed/c10d/comm.hpp>

#include "ddp_hooks/distributed_data_parallel.h"
#include "optim/zero_redundancy_optimizer.h"

namespace dtrain::ddp_hooks {

enum class ZeroStepSchedule {
  kAfterBackward,  // hook_with_zero_step
  kInterleaved,    // hook_with_zero_step_interleaved
};

class ZeroOverlapHook : public c10d::CommHookInterface, public NotJoinable {
 public:
  // Wraps `inner` (the gradient reduction, e.g. AllReduceHook or a compression hook). REQUIRES:
  // zero built with ZeroOptions::overlap_with_ddp over exactly ddp's parameters, no step taken
  // yet. Errors name the mismatch. `ddp` and `zero` must outlive the hook.
  ZeroOverlapHook(std::unique_ptr<c10d::CommHookInterface> inner, const DistributedDataParallel& ddp,
                  optim::ZeroRedundancyOptimizer& zero, bool shard_buckets, ZeroStepSchedule schedule);
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override;
  std::string why_not_joinable() const override;

  // ZeRO parameter indices per DDP bucket, in bucket order.
  const std::vector<std::vector<int64_t>>& bucket_params() const { return bucket_params_; }

 private:
  // Waits for bucket b's reduction, steps its parameters this rank owns, starts their broadcasts.
  void step_bucket(size_t b);

  std::unique_ptr<c10d::CommHookInterface> inner_;
  optim::ZeroRedundancyOptimizer& zero_;
  std::vector<std::vector<int64_t>> bucket_params_;
  struct Pending {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    std::vector<at::Tensor> layout;  // the bucket's gradient views (offsets and shapes)
    at::Tensor buffer;
  };
  std::vector<Pending> pending_;
  std::vector<c10::intrusive_ptr<c10d::Work>> broadcasts_;
  size_t expected_ = 0;
  ZeroStepSchedule schedule_;
};

// PyTorch's two hooks (see the top of this file).
std::unique_ptr<c10d::CommHookInterface> hook_with_zero_step(std::unique_ptr<c10d::CommHookInterface> inner,
                                                             const DistributedDataParallel& ddp,
                                                             optim::ZeroRedundancyOptimizer& zero,
                                                             bool shard_buckets = false);
std::unique_ptr<c10d::CommHookInterface> hook_with_zero_step_interleaved(
    std::unique_ptr<c10d::CommHookInterface> inner, const DistributedDataParallel& ddp,
    optim::ZeroRedundancyOptimizer& zero, bool shard_buckets = false);

}  // namespace dtrain::ddp_hooks

#endif  // DTRAIN_DDP_HOOKS_ZERO_HOOK_H_
