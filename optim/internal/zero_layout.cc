#include "optim/internal/zero_layout.h"

#include <c10/core/GradMode.h>

namespace dtrain::optim::internal {

at::Tensor evaluate_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return at::Tensor();
  c10::AutoGradMode enable(true);
  return closure();
}

void wait_all(const Works& works) {
  for (const auto& w : works) w->wait();
}

ZeroLayout::ZeroLayout(const std::vector<std::vector<at::Tensor>>& groups, comm::Group group)
    : group_(std::move(group)) {
  for (const auto& g : groups) {
    group_sizes_.emplace_back();
    for (const auto& p : g) {
      params_.push_back(p);
      group_sizes_.back().push_back(p.numel());
    }
  }
}

std::vector<at::Tensor> ZeroLayout::gradients() const {
  std::vector<at::Tensor> out;
  for (const auto& p : params_) {
    if (p.grad().defined()) out.push_back(p.grad());
  }
  return out;
}

int64_t ZeroLayout::gradient_bytes() const {
  int64_t bytes = 0;
  for (const at::Tensor& g : gradients()) bytes += g.numel() * g.element_size();
  return bytes;
}

std::vector<size_t> ZeroLayout::group_counts() const {
  std::vector<size_t> counts;
  for (const auto& g : group_sizes_) counts.push_back(g.size());
  return counts;
}

}  // namespace dtrain::optim::internal
