// ./bazelw run -c opt //optim:functional_benchmark
// Step time of each functional optimizer on 16M fp32 parameters, as 64 tensors and as 1 tensor,
// with two counters:
//   ratio_to_floor          step time / (bytes the step must move / copy bandwidth), the copy
//                           bandwidth measured in this run (parallel memcpy, read + write bytes).
//                           memcpy also pays a write-allocate read of its destination, which the
//                           in-place updates here do not, so values somewhat below 1 are possible.
//   speedup_vs_torch_optim  LibTorch's torch::optim step time on the same tensors (measured in
//                           this run) / ours, where LibTorch has the optimizer
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "optim/functional_optimizers.h"

namespace dtrain::optim {
namespace {

constexpr int64_t kTotal = int64_t{16} << 20;

std::vector<at::Tensor> make_tensors(int64_t count) {
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < count; ++i) out.push_back(at::randn({kTotal / count}));
  return out;
}

template <typename F>
double best_seconds(int reps, F&& f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// Read + write bytes per second of a parallel memcpy of 64 MiB.
double copy_bandwidth() {
  static const double bw = [] {
    at::Tensor src = at::randn({kTotal}), dst = at::empty({kTotal});
    const char* s = static_cast<const char*>(src.data_ptr());
    char* d = static_cast<char*>(dst.data_ptr());
    const int64_t bytes = kTotal * 4;
    const double t = best_seconds(20, [&] {
      at::parallel_for(0, bytes, int64_t{1} << 20, [&](int64_t b, int64_t e) { std::memcpy(d + b, s + b, e - b); });
    });
    return 2.0 * bytes / t;
  }();
  return bw;
}

enum class Kind { kSGD, kSGDMomentum, kAdam, kAdamW, kAdagrad, kAdadelta, kAdamax, kRMSprop, kRprop };

// Bytes per parameter a step must read and write (parameter, gradient, state).
int bytes_per_param(Kind k) {
  switch (k) {
    case Kind::kSGD: return 12;                         // r p,g  w p
    case Kind::kSGDMomentum: return 20;                 // r p,g,buf  w p,buf
    case Kind::kAdagrad: case Kind::kRMSprop: return 20;  // r p,g,s  w p,s
    default: return 28;                                 // r p,g,s1,s2  w p,s1,s2
  }
}

std::unique_ptr<FunctionalOptimizer> make_ours(Kind k, std::vector<at::Tensor> p) {
  switch (k) {
    case Kind::kSGD: return std::make_unique<FunctionalSGD>(p, SGDOptions(1e-3));
    case Kind::kSGDMomentum: return std::make_unique<FunctionalSGD>(p, SGDOptions(1e-3).momentum(0.9));
    case Kind::kAdam: return std::make_unique<FunctionalAdam>(p, AdamOptions());
    case Kind::kAdamW: return std::make_unique<FunctionalAdamW>(p, AdamWOptions());
    case Kind::kAdagrad: return std::make_unique<FunctionalAdagrad>(p, AdagradOptions());
    case Kind::kAdadelta: return std::make_unique<FunctionalAdadelta>(p, AdadeltaOptions());
    case Kind::kAdamax: return std::make_unique<FunctionalAdamax>(p, AdamaxOptions());
    case Kind::kRMSprop: return std::make_unique<FunctionalRMSprop>(p, RMSpropOptions());
    case Kind::kRprop: return std::make_unique<FunctionalRprop>(p, RpropOptions());
  }
  return nullptr;
}

std::unique_ptr<torch::optim::Optimizer> make_torch(Kind k, std::vector<at::Tensor> p) {
  switch (k) {
    case Kind::kSGD: return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(1e-3));
    case Kind::kSGDMomentum: return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(1e-3).momentum(0.9));
    case Kind::kAdam: return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions());
    case Kind::kAdamW: return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions());
    case Kind::kAdagrad: return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions());
    case Kind::kRMSprop: return std::make_unique<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions());
    default: return nullptr;
  }
}

// torch::optim's step time on the same layout, measured once per (optimizer, layout).
double torch_seconds(Kind k, int64_t count) {
  static std::map<std::pair<int, int64_t>, double> cache;
  auto key = std::make_pair(static_cast<int>(k), count);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  std::vector<at::Tensor> params = make_tensors(count);
  for (auto& p : params) {
    p.requires_grad_();
    p.mutable_grad() = at::randn_like(p);
  }
  auto opt = make_torch(k, params);
  double t = 0;
  if (opt) {
    opt->step();  // state allocation
    // Mean over several steps, the statistic our rows use too.
    constexpr int kSteps = 8;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kSteps; ++i) opt->step();
    t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / kSteps;
  }
  cache[key] = t;
  return t;
}

void BM_Functional(benchmark::State& state, Kind kind) {
  const int64_t count = state.range(0);
  std::vector<at::Tensor> params = make_tensors(count);
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(at::randn_like(p));
  auto opt = make_ours(kind, params);
  opt->step(grads);  // state allocation outside the timed loop
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) opt->step(grads);
  const double per_step =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / static_cast<double>(state.iterations());
  const double floor_seconds = static_cast<double>(bytes_per_param(kind)) * kTotal / copy_bandwidth();
  state.counters["ratio_to_floor"] = per_step / floor_seconds;
  state.counters["copy_GBps"] = copy_bandwidth() / 1e9;
  if (double t = torch_seconds(kind, count); t > 0) {
    state.counters["speedup_vs_torch_optim"] = t / per_step;
    state.counters["torch_optim_ms"] = t * 1e3;
  }
  state.SetBytesProcessed(state.iterations() * bytes_per_param(kind) * kTotal);
}

#define DTRAIN_BM(name, kind)                                                                       \
  void BM_##name(benchmark::State& state) { BM_Functional(state, kind); }                           \
  BENCHMARK(BM_##name)->ArgName("tensors")->Arg(64)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime()

DTRAIN_BM(SGD, Kind::kSGD);
DTRAIN_BM(SGDMomentum, Kind::kSGDMomentum);
DTRAIN_BM(Adam, Kind::kAdam);
DTRAIN_BM(AdamW, Kind::kAdamW);
DTRAIN_BM(Adagrad, Kind::kAdagrad);
DTRAIN_BM(Adadelta, Kind::kAdadelta);
DTRAIN_BM(Adamax, Kind::kAdamax);
DTRAIN_BM(RMSprop, Kind::kRMSprop);
DTRAIN_BM(Rprop, Kind::kRprop);

}  // namespace
}  // namespace dtrain::optim

BENCHMARK_MAIN();
