// ./bazelw run -c opt //optim/functional:optimizers_cuda_benchmark      (a CUDA GPU; every row skips without one)
// Step time of Adam, AdamW and SGD (plain and with momentum) on CUDA over 16M fp32 parameters, as
// 64 tensors and as 1 tensor -- ATen's fused multi-tensor kernels, dtrain's default on CUDA --
// each step followed by torch::cuda::synchronize() (real time), with counters:
//   ratio_to_floor          step time / the floor: the time the bytes the step must read and write
//                           (parameters, gradients, state: 28 bytes per parameter for Adam, 20
//                           for SGD with momentum, 12 for plain SGD) take at this GPU's
//                           device-to-device copy bandwidth, measured in this binary by copying a
//                           buffer of half those bytes (a copy reads and writes each byte once);
//                           1 is the memory-bandwidth limit.
//   copy_GBps               that bandwidth (bytes read + written per second).
//   speedup_vs_unfused      dtrain's own fused=False step (the per-tensor ATen ops, ~10 kernel
//                           launches per parameter, what CUDA parameters ran before) / the fused.
//   speedup_vs_torch_optim  LibTorch's torch::optim step on the same CUDA tensors / ours.
// bench/peers/adam_cuda_peer.py prints PyTorch's fused=True and foreach=True rows in the same units.
#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/cuda.h>

#include "optim/functional/optimizers.h"
#include "optim/functional/testing/benchmark_rows.h"

namespace dtrain::optim {
namespace {

constexpr int64_t kTotal = int64_t{16} << 20;

using Kind = BenchKind;

// Bytes one step must move per parameter: fp32 arrays read (parameter, gradient, state) plus
// those written back (all but the gradient).
int64_t bytes_per_param(Kind k) {
  switch (k) {
    case Kind::kSGD:
      return 4 * 3;  // r p,g      w p
    case Kind::kSGDMomentum:
      return 4 * 5;  // r p,g,b    w p,b
    default:
      return 4 * 7;  // r p,g,m,v  w p,m,v
  }
}

std::vector<at::Tensor> make_tensors(int64_t count) {
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < count; ++i) out.push_back(at::randn({kTotal / count}, at::kCUDA));
  return out;
}

std::unique_ptr<FunctionalOptimizer> make_ours(Kind k, std::vector<at::Tensor> p, bool fused) {
  const OptionalBool f = fused ? OptionalBool() : OptionalBool(false);
  switch (k) {
    case Kind::kSGD:
      return std::make_unique<FunctionalSGD>(p, SGDOptions(1e-3).fused(f));
    case Kind::kSGDMomentum:
      return std::make_unique<FunctionalSGD>(p, SGDOptions(1e-3).momentum(0.9).fused(f));
    case Kind::kAdam:
      return std::make_unique<FunctionalAdam>(p, AdamOptions().fused(f));
    case Kind::kAdamW:
      return std::make_unique<FunctionalAdamW>(p, AdamWOptions().fused(f));
    default:  // the CPU table's other rows have no CUDA row here
      return nullptr;
  }
}

// Mean seconds of `steps` calls of f, each followed by a device synchronisation, after one
// untimed call (state allocation, first launches).
template <typename F>
double mean_seconds(int steps, F&& f) {
  f();
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    f();
    torch::cuda::synchronize();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
}

// The floor for `bytes` read + written: the best of 20 device-to-device copies of bytes / 2,
// measured once per size.
double floor_seconds(int64_t bytes) {
  static std::map<int64_t, double> cache;
  if (auto it = cache.find(bytes); it != cache.end()) return it->second;
  const at::Tensor src = at::randn({bytes / 2 / 4}, at::kCUDA);
  at::Tensor dst = at::empty_like(src);
  dst.copy_(src);  // first touch
  torch::cuda::synchronize();
  double best = 1e30;
  for (int r = 0; r < 20; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    dst.copy_(src);
    torch::cuda::synchronize();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  cache[bytes] = best;
  return best;
}

// dtrain's fused=False step and LibTorch's torch::optim step on the same layout, measured once per
// (optimizer, layout).
std::pair<double, double> reference_seconds(Kind k, int64_t count) {
  static std::map<std::pair<int, int64_t>, std::pair<double, double>> cache;
  const auto key = std::make_pair(static_cast<int>(k), count);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  std::vector<at::Tensor> params = make_tensors(count);
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(at::randn_like(p));
  auto unfused = make_ours(k, params, /*fused=*/false);
  const double aten = mean_seconds(8, [&] { unfused->step(grads); });
  unfused.reset();
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].requires_grad_();
    params[i].mutable_grad() = grads[i];
  }
  auto twin = make_torch(k, params);
  const double libtorch = mean_seconds(8, [&] { twin->step(); });
  cache[key] = {aten, libtorch};
  return cache[key];
}

void BM_FunctionalCuda(benchmark::State& state, Kind kind) {
  if (!torch::cuda::is_available()) {
    state.SkipWithError("no CUDA device visible (torch::cuda::is_available() is false)");
    return;
  }
  const int64_t count = state.range(0);
  std::vector<at::Tensor> params = make_tensors(count);
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(at::randn_like(p));
  auto opt = make_ours(kind, params, /*fused=*/true);
  opt->step(grads);  // state allocation outside the timed loop
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    opt->step(grads);
    torch::cuda::synchronize();
  }
  const double per_step =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
      static_cast<double>(state.iterations());
  opt.reset();
  params.clear();
  grads.clear();
  const int64_t bytes = bytes_per_param(kind) * kTotal;
  const double floor = floor_seconds(bytes);
  state.counters["ratio_to_floor"] = per_step / floor;
  state.counters["copy_GBps"] = static_cast<double>(bytes) / floor / 1e9;
  const auto [aten, libtorch] = reference_seconds(kind, count);
  state.counters["speedup_vs_unfused"] = aten / per_step;
  state.counters["speedup_vs_torch_optim"] = libtorch / per_step;
  state.counters["torch_optim_ms"] = libtorch * 1e3;
  state.SetBytesProcessed(state.iterations() * bytes);
}

#define DTRAIN_BM(name, kind)                                                     \
  void BM_Cuda##name(benchmark::State& state) { BM_FunctionalCuda(state, kind); } \
  BENCHMARK(BM_Cuda##name)                                                        \
      ->ArgName("tensors")                                                        \
      ->Arg(64)                                                                   \
      ->Arg(1)                                                                    \
      ->Unit(benchmark::kMicrosecond)                                             \
      ->UseRealTime()

DTRAIN_BM(SGD, Kind::kSGD);
DTRAIN_BM(SGDMomentum, Kind::kSGDMomentum);
DTRAIN_BM(Adam, Kind::kAdam);
DTRAIN_BM(AdamW, Kind::kAdamW);

}  // namespace
}  // namespace dtrain::optim

BENCHMARK_MAIN();
