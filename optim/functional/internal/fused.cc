#include "optim/functional/internal/fused.h"

namespace dtrain::optim::internal {

bool fusable(const at::Tensor& param, const at::Tensor& grad,
             const std::array<at::Tensor, 4>& slots) {
  const auto dtype = param.scalar_type();
  if (!param.device().is_cpu() || (dtype != at::kFloat && dtype != at::kDouble)) return false;
  if (!param.is_contiguous() || !grad.is_contiguous() || grad.scalar_type() != dtype) return false;
  for (const auto& s : slots) {
    if (s.defined() && (!s.is_contiguous() || s.scalar_type() != dtype)) return false;
  }
  return true;
}

namespace {

// ATen's _check_tensors_share_device_and_dtype and _check_tensors_share_sizes_and_strides for one
// tensor against its parameter (strides of size-1 dimensions do not matter).
bool same_layout(const at::Tensor& t, const at::Tensor& param) {
  if (t.layout() != at::kStrided || t.scalar_type() != param.scalar_type() ||
      t.device() != param.device() || t.sizes() != param.sizes() ||
      !t.is_non_overlapping_and_dense()) {
    return false;
  }
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) != 1 && t.stride(d) != param.stride(d)) return false;
  }
  return true;
}

}  // namespace

bool aten_fusable(const at::Tensor& param, const at::Tensor& grad,
                  const std::array<at::Tensor, 4>& slots) {
  const auto dtype = param.scalar_type();
  if (!(param.is_cuda() || param.is_cpu()) || param.numel() == 0) return false;
  if (dtype != at::kFloat && dtype != at::kDouble && dtype != at::kHalf && dtype != at::kBFloat16)
    return false;
  if (!same_layout(param, param) || !same_layout(grad, param)) return false;
  for (const auto& s : slots) {
    if (s.defined() && !same_layout(s, param)) return false;
  }
  return true;
}

}  // namespace dtrain::optim::internal
