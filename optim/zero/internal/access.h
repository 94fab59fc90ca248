// The one door into ZeroRedundancyOptimizer's private state, for the APIs that extend it from
// outside its class -- ZeroOverlap (overlap.h) and ZeroGradShards (grad_shards.h) --
// instead of a friend declaration per class: what they read, and the re-layout they trigger.
// Inside optim/ only (Bazel visibility).
//
//   if (internal::ZeroAccess::has_state(zero)) ...;        // stepped or loaded: too late to re-lay out
//   internal::ZeroAccess::options(zero).params_per_rank = partition;
//   internal::ZeroAccess::relayout(zero);
#ifndef DTRAIN_OPTIM_ZERO_INTERNAL_ACCESS_H_
#define DTRAIN_OPTIM_ZERO_INTERNAL_ACCESS_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::optim::internal {

class ZeroAccess {
 public:
  static ZeroOptions& options(ZeroRedundancyOptimizer& z) { return z.options_; }
  static ZeroLayout* layout(const ZeroRedundancyOptimizer& z) { return z.layout_.get(); }
  static torch::optim::Optimizer& local_optimizer(ZeroRedundancyOptimizer& z) { return *z.local_; }
  // A step ran or state was loaded: the state belongs to the current layout.
  static bool has_state(const ZeroRedundancyOptimizer& z) { return z.stepped_ || z.state_loaded_; }
  // ZeRO-2's buckets (global parameter indices per DDP bucket), read by the next relayout().
  static void set_grad_shard_buckets(ZeroRedundancyOptimizer& z,
                                     std::vector<std::vector<int64_t>> b) {
    z.grad_shard_buckets_ = std::move(b);
  }
  // Lays the parameters out again from the options (and buckets) and rebuilds the local
  // optimizer over this rank's part. REQUIRES !has_state(z).
  static void relayout(ZeroRedundancyOptimizer& z) {
    z.build_layout();
    z.build_local_optimizer();
    z.consolidated_ = c10::IValue();
  }
  // The wrapper's group options, copied into the local optimizer before a step taken from outside.
  static void sync_options_to_local(ZeroRedundancyOptimizer& z) {
    z.sync_options(/*to_local=*/true);
  }
  // Records a step taken from outside step() (a consolidated state is stale from now on).
  static void mark_stepped(ZeroRedundancyOptimizer& z) {
    z.stepped_ = true;
    z.stale_consolidation_ = z.stale_consolidation_ || !z.consolidated_.isNone();
    z.consolidated_ = c10::IValue();
  }
};

}  // namespace dtrain::optim::internal

#endif  // DTRAIN_OPTIM_ZERO_INTERNAL_ACCESS_H_
