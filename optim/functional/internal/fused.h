// Driver for fused optimizer kernels: one multi-threaded pass over the elements of many tensors
// (the multi-tensor form), with no per-tensor operator dispatch; and what the ATen-fused path
// (internal/optimizer_impl.h's drive_aten_fused) needs. Internal to optim/.
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

// The instruction sets the fused kernels are built for, widest last; kernel_isa() picks the widest
// this CPU runs. Every build gives bit-identical results: IEEE operations are correctly rounded
// whatever the vector width, and no build contracts a multiply-add (-ffp-contract=off).
// kAvx512 (AVX-512 F, VL, BW and DQ) builds only the low-precision state kernels
// (internal/adam_low_precision.h): they are compute-bound, and AVX-512's 32 vector registers,
// masks and narrowing stores took the bfloat16-state AdamW kernel from 9.1 to 5.6 ms on 16M
// elements (AMD EPYC, 2 threads, 2026-11-29). The float kernels keep their AVX2 build there: an
// AVX-512 build of those memory-bound loops measured no faster (2026-11-26).
enum class KernelIsa { kBaseline, kAvx2, kAvx512 };
// The target attribute of kAvx512's functions.
#define DTRAIN_AVX512_TARGET "avx2,avx512f,avx512vl,avx512bw,avx512dq"

// What this CPU runs.
inline KernelIsa cpu_kernel_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const KernelIsa isa =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
              __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")
          ? KernelIsa::kAvx512
      : __builtin_cpu_supports("avx2") ? KernelIsa::kAvx2
                                       : KernelIsa::kBaseline;
  return isa;
#else
  return KernelIsa::kBaseline;
#endif
}

// Tests lower it to run a narrower build on a wider CPU, to compare the builds.
inline std::atomic<KernelIsa>& kernel_isa_cap() {
  static std::atomic<KernelIsa> cap{KernelIsa::kAvx512};
  return cap;
}

// The build the fused kernels use now.
inline KernelIsa kernel_isa() {
  return std::min(cpu_kernel_isa(), kernel_isa_cap().load(std::memory_order_relaxed));
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

// True when ATen's fused multi-tensor kernels can take `param` with `grad` and the (defined)
// slots: a non-empty CUDA parameter (or CPU, for fused=True) of a dtype they dispatch (float,
// double, half, bfloat16), every tensor strided, non-overlapping and dense, with the parameter's
// dtype, device, sizes and strides (the kernels' check_fast_path_restrictions, which they enforce
// with an error).
bool aten_fusable(const at::Tensor& param, const at::Tensor& grad,
                  const std::array<at::Tensor, 4>& slots);

// How for_each_range shares the elements among threads. kEachTensor (the default): every thread
// takes its share of every tensor, so that the threads stream neighbouring parts of one tensor at
// a time, as PyTorch's CPU fused kernels do. kConcatenated: one index range over all tensors, cut
// into one contiguous piece per thread (dtrain before 2026-11-26). The benchmark compares both.
enum class FusedSplit { kEachTensor, kConcatenated };
inline std::atomic<FusedSplit>& fused_split() {
  static std::atomic<FusedSplit> split{FusedSplit::kEachTensor};
  return split;
}

// Calls kernel(tensor, begin, end) over [begin, end) element ranges that together cover every
// element of every tensor exactly once, in parallel (at::parallel_for), split as fused_split().
template <typename T, typename Kernel>
void for_each_range(const std::vector<FusedTensor<T>>& tensors, const Kernel& kernel) {
  if (tensors.empty()) return;
  int64_t total = 0;
  for (const auto& t : tensors) total += t.n;
  const int64_t threads = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), (total + kFusedGrain - 1) / kFusedGrain));
  if (fused_split().load(std::memory_order_relaxed) == FusedSplit::kEachTensor && threads > 1) {
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
      for (int64_t part = first; part < last; ++part) {
        for (const auto& t : tensors) {
          // Shares rounded to 16 elements (64 bytes in float), so no two threads write one line.
          const int64_t share = (t.n + threads - 1) / threads;
          const int64_t step = (share + 15) / 16 * 16;
          const int64_t lo = std::min(t.n, part * step), hi = std::min(t.n, lo + step);
          if (hi > lo) kernel(t, lo, hi);
        }
      }
    });
    return;
  }
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
