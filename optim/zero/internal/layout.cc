#include "optim/zero/internal/layout.h"

#include <cmath>

#include <ATen/ATen.h>
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

at::Tensor ZeroLayout::clip_grad_norm_(double max_norm, double norm_type, bool error_if_nonfinite) {
  TORCH_CHECK(norm_type > 0, "clip_grad_norm_: norm_type must be positive or infinity, got ",
              norm_type);
  const bool inf = std::isinf(norm_type);
  const std::vector<at::Tensor> grads = gradients();
  c10::NoGradGuard no_grad;
  // Accumulated where the gradients are (no host round trip per tensor on CUDA), in double, so the
  // sum over ranks does not lose what fp32 per-tensor norms keep.
  const c10::Device device = grads.empty() ? params().at(0).device() : grads.front().device();
  at::Tensor local = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (const at::Tensor& g : grads) {
    at::Tensor norm =
        at::linalg_vector_norm(g, norm_type, c10::nullopt, false, at::kDouble).to(device);
    local = inf ? at::maximum(local, norm.reshape({1})) : local + norm.pow(norm_type).reshape({1});
  }
  if (gradients_sharded() && world_size() > 1) {
    // The all-reduce's tensor lives on the group's device (cuda:<id> for NCCL, the CPU for Gloo).
    std::vector<at::Tensor> t = {local.to(group_.device())};
    c10d::AllreduceOptions o;
    o.reduceOp = inf ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
    group_->allreduce(t, o)->wait();
    local = t[0].to(device);
  }
  const at::ScalarType dtype = params().at(0).scalar_type();
  at::Tensor total = (inf ? local : local.pow(1.0 / norm_type)).reshape({}).to(dtype);
  // The host reads the norm only to refuse a non-finite one (PyTorch's check syncs there too).
  TORCH_CHECK(!error_if_nonfinite || std::isfinite(total.item<double>()),
              "The total norm of order ", norm_type,
              " for gradients from `parameters` is non-finite, so it cannot be clipped. To disable "
              "this error and "
              "scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`");
  at::Tensor coef = at::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
  for (const at::Tensor& g : grads) g.mul_(coef);
  return total;
}

std::vector<size_t> ZeroLayout::group_counts() const {
  std::vector<size_t> counts;
  for (const auto& g : group_sizes_) counts.push_back(g.size());
  return counts;
}

}  // namespace dtrain::optim::internal
