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
//
// ZeRO stage 2 (beyond PyTorch, ZeroOptions::shard_gradients): hook_with_zero2 replaces DDP's
// all-reduce. Each bucket, as backward produces it, is reduce-scattered, leaving every rank the
// averaged gradient of only its aligned range of the bucket; the bucket and the parameters' .grad
// are freed. zero.step() (after an optional zero.clip_grad_norm_) steps those ranges and
// all-gathers the updated parameters bucket by bucket. Per rank and iteration that sends
// 2(n-1)/n of the model's bytes (DDP + ZeRO-1: 3(n-1)/n) and keeps about 1/n of the gradients.
//
//   dtrain::optim::ZeroOptions zo;
//   zo.group = world;
//   zo.shard_gradients = true;
//   dtrain::optim::ZeroRedundancyOptimizer zero(model->parameters(), ..., zo);
//   ddp.register_comm_hook(dtrain::ddp_hooks::hook_with_zero2(ddp, zero));
//   for (...) { ddp.forward(...).backward(); zero.clip_grad_norm_(1.0); zero.step(); }
//
// Gradients accumulate across backward passes inside ddp.no_sync() (in .grad, full size, as in
// PyTorch); each synchronised backward replaces the reduced slices, whether or not zero_grad()
// ran. Works inside a comm::Join with both DDP and the optimizer as joinables (a joined rank
// reduce-scatters zeros and still steps and all-gathers its ranges).
#ifndef DTRAIN_DDP_HOOKS_ZERO_HOOK_H_
#define DTRAIN_DDP_HOOKS_ZERO_HOOK_H_

#include <memory>
#include <vector>

#include <torch/csrc/distributed/c10d/comm.hpp>

#include "comm/reduce_scatter.h"
#include "ddp_hooks/bucket_hook.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::ddp_hooks {

enum class ZeroStepSchedule {
  kAfterBackward,  // hook_with_zero_step
  kInterleaved,    // hook_with_zero_step_interleaved
};

namespace internal {
class OrderedWorker;
}  // namespace internal

// Both hooks return from runHook at once and do their waiting, stepping and collectives on the
// DDP group's hook thread (ddp_hooks/internal/ordered_worker.h), in bucket order on every rank,
// while backward goes on.
class ZeroOverlapHook : public c10d::CommHookInterface, public NotJoinable {
 public:
  // Wraps `inner` (the gradient reduction, e.g. AllReduceHook or a compression hook). REQUIRES:
  // zero built with ZeroOptions::overlap_with_ddp over exactly ddp's parameters, no step taken
  // yet. Errors name the mismatch. `ddp` and `zero` must outlive the hook.
  ZeroOverlapHook(std::unique_ptr<c10d::CommHookInterface> inner,
                  const DistributedDataParallel& ddp, optim::ZeroRedundancyOptimizer& zero,
                  bool shard_buckets, ZeroStepSchedule schedule);
  ~ZeroOverlapHook() override;
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override;
  std::string why_not_joinable() const override;

  // ZeRO parameter indices per DDP bucket, in bucket order.
  const std::vector<std::vector<int64_t>>& bucket_params() const { return bucket_params_; }

 private:
  // On the worker: starts bucket b's reduction, and steps what the schedule says is due.
  c10::intrusive_ptr<c10::ivalue::Future> run(c10d::GradBucket& bucket);
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
  size_t expected_ = 0;  // checked on the calling thread
  ZeroStepSchedule schedule_;
  std::shared_ptr<internal::OrderedWorker> worker_;
  c10::intrusive_ptr<c10::ivalue::Future> last_;  // waited for by the destructor
};

// PyTorch's two hooks (see the top of this file).
std::unique_ptr<c10d::CommHookInterface> hook_with_zero_step(
    std::unique_ptr<c10d::CommHookInterface> inner, const DistributedDataParallel& ddp,
    optim::ZeroRedundancyOptimizer& zero, bool shard_buckets = false);
std::unique_ptr<c10d::CommHookInterface> hook_with_zero_step_interleaved(
    std::unique_ptr<c10d::CommHookInterface> inner, const DistributedDataParallel& ddp,
    optim::ZeroRedundancyOptimizer& zero, bool shard_buckets = false);

// ZeRO-2's hook (see the top of this file).
class ZeroGradShardHook : public BucketHook, public GradientConsumer {
 public:
  // REQUIRES: zero built with ZeroOptions::shard_gradients over exactly ddp's parameters, on a
  // group with the same ranks as DDP's, no step taken yet. Lays ZeRO's parameters out by DDP
  // bucket. `ddp` and `zero` must outlive the hook.
  ZeroGradShardHook(const DistributedDataParallel& ddp, optim::ZeroRedundancyOptimizer& zero);
  ~ZeroGradShardHook() override;
  // Starts bucket b's reduce-scatter on the worker (after finishing bucket b-1's: at most two in
  // flight); waits only when the worker is two buckets behind (a bound on the buffers kept).
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  // Waits for the last reduce-scatters; the slices are ready for zero.step().
  void finish_backward() override;

 private:
  // On the worker: finishes bucket b-1's reduce-scatter and starts bucket b's.
  c10::intrusive_ptr<c10::ivalue::Future> run(c10d::GradBucket& bucket);
  void finish(size_t b);

  // Where Gloo has no collectives for the gradients' dtype (gloo_reduces: bfloat16 and float16 on
  // Debian sid's LibTorch 2.14), bucket b's chunks go to their ranks as bytes (an all-to-all, the
  // traffic of the reduce-scatter) and finish() sums them here in float32, rounding once.
  struct ByteExchange {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor received;  // [world, chunk]: row r from rank r
    at::Tensor output;    // this rank's gradient chunk
  };
  ByteExchange exchange_bytes(const at::Tensor& input, const at::Tensor& output);

  optim::ZeroRedundancyOptimizer& zero_;
  comm::Group group_;
  std::vector<comm::ReduceScatterWork> pending_;
  std::vector<ByteExchange> exchanges_;
  size_t expected_ = 0;  // checked on the calling thread
  std::shared_ptr<internal::OrderedWorker> worker_;
  c10::intrusive_ptr<c10::ivalue::Future> last_;
};

std::unique_ptr<c10d::CommHookInterface> hook_with_zero2(const DistributedDataParallel& ddp,
                                                         optim::ZeroRedundancyOptimizer& zero);

}  // namespace dtrain::ddp_hooks

#endif  // DTRAIN_DDP_HOOKS_ZERO_HOOK_H_
