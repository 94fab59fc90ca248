#include "optim/zero/overlap.h"

#include <c10/core/GradMode.h>

#include "optim/zero/internal/access.h"
#include "optim/zero/internal/layout.h"

namespace dtrain::optim {

using internal::ZeroAccess;

internal::WholeParamLayout& ZeroOverlap::layout() {
  auto* whole = dynamic_cast<internal::WholeParamLayout*>(ZeroAccess::layout(zero_));
  TORCH_CHECK(ZeroAccess::options(zero_).overlap_with_ddp && whole != nullptr,
              "the ZeRO overlap API is for overlap_with_ddp: "
              "set ZeroOptions::overlap_with_ddp = true (whole parameters, kSortedGreedy)");
  return *whole;
}

void ZeroOverlap::set_partition(std::vector<std::vector<int64_t>> params_per_rank) {
  TORCH_CHECK(ZeroAccess::options(zero_).overlap_with_ddp,
              "set_overlap_partition is for overlap_with_ddp: set "
              "ZeroOptions::overlap_with_ddp = true");
  TORCH_CHECK(!ZeroAccess::has_state(zero_),
              "the ZeRO overlap hook must be registered before the first "
              "step and before loading a checkpoint: the optimizer already holds state for the old "
              "partition");
  ZeroAccess::options(zero_).params_per_rank = std::move(params_per_rank);
  ZeroAccess::relayout(zero_);
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
  auto& adapter = dynamic_cast<FunctionalOptimizerAdapter&>(ZeroAccess::local_optimizer(zero_));
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
  ZeroAccess::sync_options_to_local(zero_);
  c10::NoGradGuard no_grad;
  adapter.functional(0).step(local_grads);
  ZeroAccess::mark_stepped(zero_);
}

std::vector<c10::intrusive_ptr<c10d::Work>> ZeroOverlap::broadcast(
    const std::vector<int64_t>& params) {
  internal::Works works;
  layout().broadcast(params, works);
  return works;
}

}  // namespace dtrain::optim
