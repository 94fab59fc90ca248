// ./bazelw run -c opt //optim/functional:optimizers_benchmark
// Step time of each functional optimizer on 16M fp32 parameters, as 64 tensors and as 1 tensor,
// with two counters:
//   ratio_to_floor          step time / the floor: the best time, in this run, of a STREAM-like
//                           kernel that reads and writes the same arrays in place with the same
//                           threads (floor_seconds); 1 is the machine's limit for that mix, and
//                           floor_GBps is the rate it reached.
//   speedup_vs_torch_optim  LibTorch's torch::optim step time on the same tensors (measured in
//                           this run) / ours, where LibTorch has the optimizer
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "optim/functional/optimizers.h"

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
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// The floor's kernels: read 2, 3 or 4 arrays, write all but the second in place (the gradient's
// place), one multiply-add per element, restrict-qualified so that the compiler vectorizes them,
// in the widest vector instructions this CPU has (one clone each, chosen at load time).
#define DTRAIN_WIDEST __attribute__((target_clones("avx512f", "avx2", "default")))
DTRAIN_WIDEST void stream2(float* __restrict a, const float* __restrict b, int64_t n) {
  for (int64_t k = 0; k < n; ++k) a[k] += 0.5f * b[k];
}
DTRAIN_WIDEST void stream3(float* __restrict a, const float* __restrict b, float* __restrict c,
                           int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const float ck = 0.9f * c[k] + b[k];
    c[k] = ck;
    a[k] += 0.5f * ck;
  }
}
DTRAIN_WIDEST void stream4(float* __restrict a, const float* __restrict b, float* __restrict c,
                           float* __restrict d, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const float ck = 0.9f * c[k] + b[k], dk = 0.99f * d[k] + b[k];
    c[k] = ck;
    d[k] = dk;
    a[k] += 0.5f * ck + 0.25f * dk;
  }
}

// The floor: the best time this machine takes, in this run, to stream the arrays an optimizer step
// reads and writes -- `reads` float arrays of kTotal elements read, the first `writes` of them
// written back in place, one multiply-add per element and nothing else -- with at::parallel_for's
// threads and grain, as the fused steps use. STREAM's kernels, with the step's own read/write mix.
// Measured right after each row's timed loop, so that both see the machine in the same minute.
double floor_seconds(int reads, int writes) {
  std::vector<at::Tensor> arrays;
  for (int r = 0; r < reads; ++r) arrays.push_back(at::randn({kTotal}));
  float* a = arrays[0].data_ptr<float>();
  const float* b = arrays[1].data_ptr<float>();
  float* c = reads > 2 ? arrays[2].data_ptr<float>() : nullptr;
  float* d = reads > 3 ? arrays[3].data_ptr<float>() : nullptr;
  auto pass = [&] {
    at::parallel_for(0, kTotal, int64_t{1} << 16, [&](int64_t lo, int64_t hi) {
      if (reads == 2) {
        stream2(a + lo, b + lo, hi - lo);
      } else if (reads == 3) {
        stream3(a + lo, b + lo, c + lo, hi - lo);
      } else {
        stream4(a + lo, b + lo, c + lo, d + lo, hi - lo);
      }
    });
  };
  TORCH_CHECK(writes == reads - 1 && reads >= 2 && reads <= 4, "no floor kernel reads ", reads,
              " writes ", writes);
  pass();  // first touch
  return best_seconds(20, pass);
}

enum class Kind {
  kSGD,
  kSGDMomentum,
  kAdam,
  kAdamW,
  kAdagrad,
  kAdadelta,
  kAdamax,
  kRMSprop,
  kRprop
};

// fp32 arrays a step must read (parameter, gradient, state); it writes all but the gradient.
int arrays_read(Kind k) {
  switch (k) {
    case Kind::kSGD:
      return 2;  // r p,g  w p
    case Kind::kSGDMomentum:
    case Kind::kAdagrad:
    case Kind::kRMSprop:
      return 3;  // r p,g,s  w p,s
    default:
      return 4;  // r p,g,s1,s2  w p,s1,s2
  }
}
int bytes_per_param(Kind k) { return 4 * (2 * arrays_read(k) - 1); }

std::unique_ptr<FunctionalOptimizer> make_ours(Kind k, std::vector<at::Tensor> p) {
  switch (k) {
    case Kind::kSGD:
      return std::make_unique<FunctionalSGD>(p, SGDOptions(1e-3));
    case Kind::kSGDMomentum:
      return std::make_unique<FunctionalSGD>(p, SGDOptions(1e-3).momentum(0.9));
    case Kind::kAdam:
      return std::make_unique<FunctionalAdam>(p, AdamOptions());
    case Kind::kAdamW:
      return std::make_unique<FunctionalAdamW>(p, AdamWOptions());
    case Kind::kAdagrad:
      return std::make_unique<FunctionalAdagrad>(p, AdagradOptions());
    case Kind::kAdadelta:
      return std::make_unique<FunctionalAdadelta>(p, AdadeltaOptions());
    case Kind::kAdamax:
      return std::make_unique<FunctionalAdamax>(p, AdamaxOptions());
    case Kind::kRMSprop:
      return std::make_unique<FunctionalRMSprop>(p, RMSpropOptions());
    case Kind::kRprop:
      return std::make_unique<FunctionalRprop>(p, RpropOptions());
  }
  return nullptr;
}

std::unique_ptr<torch::optim::Optimizer> make_torch(Kind k, std::vector<at::Tensor> p) {
  switch (k) {
    case Kind::kSGD:
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(1e-3));
    case Kind::kSGDMomentum:
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(1e-3).momentum(0.9));
    case Kind::kAdam:
      return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions());
    case Kind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions());
    case Kind::kAdagrad:
      return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions());
    case Kind::kRMSprop:
      return std::make_unique<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions());
    default:
      return nullptr;
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
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
      static_cast<double>(state.iterations());
  const double floor = floor_seconds(arrays_read(kind), arrays_read(kind) - 1);
  state.counters["ratio_to_floor"] = per_step / floor;
  state.counters["floor_GBps"] = static_cast<double>(bytes_per_param(kind)) * kTotal / floor / 1e9;
  if (double t = torch_seconds(kind, count); t > 0) {
    state.counters["speedup_vs_torch_optim"] = t / per_step;
    state.counters["torch_optim_ms"] = t * 1e3;
  }
  state.SetBytesProcessed(state.iterations() * bytes_per_param(kind) * kTotal);
}

#define DTRAIN_BM(name, kind)                                             \
  void BM_##name(benchmark::State& state) { BM_Functional(state, kind); } \
  BENCHMARK(BM_##name)                                                    \
      ->ArgName("tensors")                                                \
      ->Arg(64)                                                           \
      ->Arg(1)                                                            \
      ->Unit(benchmark::kMillisecond)                                     \
      ->UseRealTime()

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
