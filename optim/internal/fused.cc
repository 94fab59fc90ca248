#include "optim/internal/fused.h"

namespace dtrain::optim::internal {

bool fusable(const at::Tensor& param, const at::Tensor& grad, const std::array<at::Tensor, 4>& slots) {
  const auto dtype = param.scalar_type();
  if (!param.device().is_cpu() || (dtype != at::kFloat && dtype != at::kDouble)) return false;
  if (!param.is_contiguous() || !grad.is_contiguous() || grad.scalar_type() != dtype) return false;
  for (const auto& s : slots) {
    if (s.defined() && (!s.is_contiguous() || s.scalar_type() != dtype)) return false;
  }
  return true;
}

}  // namespace dtrain::optim::internal
