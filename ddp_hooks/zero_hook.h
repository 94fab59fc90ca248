// PyTorch's hook_with_zero_step: ZeroRedundancyOptimizer's step inside DDP's communication hook.
// As each bucket's all-reduce finishes, the ranks owning its parameters step them with the
// averaged gradients and broadcast them, while backward and the next buckets' all-reduces
// continue; by the end of backward every parameter is updated and synchronised, and
// zero.step() has nothing left to do.
//
//   dtrain::ddp::DistributedDataParallel ddp(model, ddp_options);
//   dtrain::optim::ZeroOptions zo;
//   zo.group = world;
//   zo.overlap_with_ddp = true;
//   dtrain::optim::ZeroRedundancyOptimizer zero(
//       model->parameters(), dtrain::optim::local_optimizer<dtrain::optim::FunctionalOptimizerAdapter>("Adam", o), zo);
//   ddp.register_comm_hook(dtrain::ddp::hook_with_zero_step(
//       std::make_unique<dtrain::ddp::AllReduceHook>(world), ddp, zero));
//   for (...) { zero.zero_grad(); ddp.forward(...).backward(); zero.step(); }
//
// The ZeRO parameters must be exactly DDP's parameters (one group). Parameters are re-partitioned
// by DDP bucket (whole buckets round-robin, or slices of buckets with shard_buckets, PyTorch's
// assignment), so register the hook before the first step. Unlike PyTorch, the first iterations
// are not spent on warm-up: every iteration updates the model. Not for use inside a Join (a
// joined rank's shadow all-reduces would step with zero gradients).
#ifndef DTRAIN_DDP_HOOKS_ZERO_HOOK_H_
#define DTRAIN_DDP_HOOKS_ZERO_HOOK_H_

#include <memory>
#include <vector>

#include <torch/csrc/distributed/c10d/comm.hpp>

#include "ddp_hooks/distributed_data_parallel.h"
#include "optim/zero_redundancy_optimizer.h"

namespace dtrain::ddp {

class ZeroOverlapHook : public c10d::CommHookInterface {
 public:
  // Wraps `inner` (the gradient reduction, e.g. AllReduceHook or a compression hook). REQUIRES:
  // zero built with ZeroOptions::overlap_with_ddp over exactly ddp's parameters, no step taken
  // yet. Errors name the mismatch. `ddp` and `zero` must outlive the hook.
  ZeroOverlapHook(std::unique_ptr<c10d::CommHookInterface> inner, const DistributedDataParallel& ddp,
                  optim::ZeroRedundancyOptimizer& zero, bool shard_buckets);
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override;

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
};

// PyTorch's name for it.
std::unique_ptr<c10d::CommHookInterface> hook_with_zero_step(std::unique_ptr<c10d::CommHookInterface> inner,
                                                             const DistributedDataParallel& ddp,
                                                             optim::ZeroRedundancyOptimizer& zero,
                                                             bool shard_buckets = false);

}  // namespace dtrain::ddp

#endif  // DTRAIN_DDP_HOOKS_ZERO_HOOK_H_
