// Driver for fused optimizer kernels: one multi-threaded pass over the elements of many tensors
// (the multi-tensor form), with no per-tensor operator dispatch; and what the CUDA path (ATen's
// fused multi-tensor kernels, internal/functional_impl.h's drive_cuda) needs. Internal to optim/.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_FUSED_H_
#define DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_FUSED_H_

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

namespace dtrain::optim::internal {

// One tensor's part in a fused update: parameter, gradient, up to four state slots, and
// per-tensor scalars (bias corrections and the like, which depend on the tensor's own step).
template <typename T>
struct FusedTensor {
  T* p = nullptr;
  const T* g = nullptr;
  std::array<T*, 4> s{};
  int64_t n = 0;
  std::array<double, 4> c{};
  bool first = false;  // first update of this tensor (SGD creates its momentum buffer from it)
};

// Tests set this to run the baseline (SSE2) kernels on an AVX2 machine, to compare the two.
inline std::atomic<bool>& baseline_kernels_only() {
  static std::atomic<bool> only{false};
  return only;
}

// Whether the fused kernels use their AVX2 build: this CPU runs AVX2 code and no test said no.
inline bool cpu_has_avx2() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has = __builtin_cpu_supports("avx2");
  return has && !baseline_kernels_only().load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// The CUDA multi-tensor updates the optimizers ran, one per (device, dtype) batch: through one of
// ATen's fused kernels, or through its _foreach_ ops where ATen has no fused CUDA kernel (Adagrad
// in LibTorch 2.6). Tests read them to see which path a step took.
struct CudaPathCounts {
  std::atomic<int64_t> fused{0};
  std::atomic<int64_t> foreach{0};
};
inline CudaPathCounts& cuda_path_counts() {
  static CudaPathCounts counts;
  return counts;
}

// Elements per task: large enough to amortise scheduling, small enough to split 1-tensor models.
constexpr int64_t kFusedGrain = int64_t{1} << 16;

// True when the fused path can run on `param` with `grad` and the (defined) slots: CPU, float or
// double, everything contiguous.
bool fusable(const at::Tensor& param, const at::Tensor& grad,
             const std::array<at::Tensor, 4>& slots);

// True when ATen's fused CUDA kernels can take `param` with `grad` and the (defined) slots: a
// non-empty CUDA parameter of a dtype they dispatch (float, double, half, bfloat16), every tensor
// strided, non-overlapping and dense, with the parameter's dtype, device, sizes and strides (the
// kernels' check_fast_path_restrictions, which they enforce with an error).
bool cuda_fusable(const at::Tensor& param, const at::Tensor& grad,
                  const std::array<at::Tensor, 4>& slots);

// Calls kernel(tensor, begin, end) over [begin, end) element ranges that together cover every
// element of every tensor exactly once, in parallel (at::parallel_for).
template <typename T, typename Kernel>
void for_each_range(const std::vector<FusedTensor<T>>& tensors, const Kernel& kernel) {
  if (tensors.empty()) return;
  std::vector<int64_t> start(tensors.size() + 1, 0);
  for (size_t i = 0; i < tensors.size(); ++i) start[i + 1] = start[i] + tensors[i].n;
  at::parallel_for(0, start.back(), kFusedGrain, [&](int64_t begin, int64_t end) {
    size_t t =
        static_cast<size_t>(std::upper_bound(start.begin(), start.end(), begin) - start.begin()) -
        1;
    for (; t < tensors.size() && start[t] < end; ++t) {
      const int64_t lo = std::max(begin, start[t]) - start[t];
      const int64_t hi = std::min(end, start[t + 1]) - start[t];
      if (hi > lo) kernel(tensors[t], lo, hi);
    }
  });
}

}  // namespace dtrain::optim::internal

#endif  // DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_FUSED_H_
