// ./bazelw run -c opt //optim/functional:optimizers_benchmark
// Step time of each functional optimizer on 16M fp32 parameters, as 64 tensors and as 1 tensor,
// with two counters:
//   ratio_to_floor          step time / the floor: the best time, in this run, of a STREAM-like
//                           kernel that reads and writes the same arrays in place with the same
//                           threads (floor_seconds); 1 is the machine's limit for that mix, and
//                           floor_GBps is the rate it reached.
//   ratio_to_layout_floor   the same, the floor's arrays split into as many separately allocated
//                           tensors as the row has (64 or 1): what its memory layout allows
//   speedup_vs_torch_optim  LibTorch's torch::optim step time on the same tensors (measured in
//                           this run) / ours, where LibTorch has the optimizer
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include "optim/functional/internal/fused.h"
#include "optim/functional/optimizers.h"
#include "optim/functional/testing/benchmark_rows.h"

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
// reads and writes -- `reads` float streams of kTotal elements read, the first `writes` of them
// written back in place -- with at::parallel_for's threads: the fastest of STREAM's kernels with
// the step's own read/write mix (one multiply-add per element, two ways of sharing the arrays
// among the threads) and ATen's fused optimizer kernel with that mix.
// `pieces`: each stream as that many separately allocated arrays (the row's own layout: 64
// tensors are 64 allocations per stream), walked as the fused driver walks its tensors (one
// index range over all of them, split among the threads). Measured right after each row's timed
// loop, so that both see the machine in the same minute.
double floor_seconds(int reads, int writes, int64_t pieces) {
  TORCH_CHECK(writes == reads - 1 && reads >= 2 && reads <= 4, "no floor kernel reads ", reads,
              " writes ", writes);
  const int64_t n = kTotal / pieces;
  std::vector<std::vector<at::Tensor>> arrays(reads);
  for (int64_t i = 0; i < pieces; ++i)
    for (int r = 0; r < reads; ++r) arrays[r].push_back(at::randn({n}));
  auto piece = [&](int64_t i, int64_t lo, int64_t hi) {
    float* a = arrays[0][i].data_ptr<float>() + lo;
    const float* b = arrays[1][i].data_ptr<float>() + lo;
    if (reads == 2) return stream2(a, b, hi - lo);
    float* c = arrays[2][i].data_ptr<float>() + lo;
    if (reads == 3) return stream3(a, b, c, hi - lo);
    stream4(a, b, c, arrays[3][i].data_ptr<float>() + lo, hi - lo);
  };
  // The two walks of internal/fused.h's for_each_range: one range over all arrays cut into a piece
  // per thread, and every thread its share of each array in turn. The floor is the faster.
  auto concatenated = [&] {
    at::parallel_for(0, kTotal, int64_t{1} << 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo / n; i < pieces && i * n < hi; ++i)
        piece(i, std::max(lo, i * n) - i * n, std::min(hi, (i + 1) * n) - i * n);
    });
  };
  const int64_t threads = at::get_num_threads();
  auto each_array = [&] {
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
      const int64_t step = ((n + threads - 1) / threads + 15) / 16 * 16;
      for (int64_t part = first; part < last; ++part)
        for (int64_t i = 0; i < pieces; ++i)
          if (part * step < n) piece(i, part * step, std::min(n, (part + 1) * step));
    });
  };
  // ATen's own fused CPU kernel with the same mix -- Adam's (4 read, 3 written), SGD's with
  // momentum (3, 2) or without (2, 1) -- on the same arrays: it streams faster than the loops above
  // on some machines (this one, 2026-11-26), so it is a candidate floor too.
  std::vector<at::Tensor> steps;
  for (int64_t i = 0; i < pieces; ++i) steps.push_back(at::zeros({}, at::kFloat));
  auto aten = [&] {
    if (reads == 4) {
      at::_fused_adam_(arrays[0], arrays[1], arrays[2], arrays[3], {}, steps, 1e-3, 0.9, 0.999, 0,
                       1e-8, false, false);
    } else {
      at::_fused_sgd_(arrays[0], arrays[1], reads == 3 ? arrays[2] : std::vector<at::Tensor>{}, 0,
                      reads == 3 ? 0.9 : 0.0, 1e-3, 0, false, false, false);
    }
  };
  concatenated();  // first touch
  return std::min(
      {best_seconds(20, concatenated), best_seconds(20, each_array), best_seconds(20, aten)});
}

using Kind = BenchKind;

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

// fused_true: PyTorch's fused=True (ATen's CPU fused kernel), for Adam and SGD with momentum.
std::unique_ptr<FunctionalOptimizer> make_ours(Kind k, std::vector<at::Tensor> p,
                                               bool fused_true = false) {
  if (fused_true && k == Kind::kAdam)
    return std::make_unique<FunctionalAdam>(p, AdamOptions().fused(true));
  if (fused_true && k == Kind::kSGDMomentum)
    return std::make_unique<FunctionalSGD>(p, SGDOptions(1e-3).momentum(0.9).fused(true));
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

void BM_Functional(benchmark::State& state, Kind kind,
                   internal::FusedSplit split = internal::FusedSplit::kEachTensor,
                   bool fused_true = false) {
  const internal::FusedSplit saved = internal::fused_split().exchange(split);
  const int64_t count = state.range(0);
  std::vector<at::Tensor> params = make_tensors(count);
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(at::randn_like(p));
  auto opt = make_ours(kind, params, fused_true);
  opt->step(grads);  // state allocation outside the timed loop
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) opt->step(grads);
  const double per_step =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
      static_cast<double>(state.iterations());
  const double floor = floor_seconds(arrays_read(kind), arrays_read(kind) - 1, 1);
  state.counters["ratio_to_floor"] = per_step / floor;
  // The same floor over `count` arrays per stream: what the row's own layout allows.
  state.counters["ratio_to_layout_floor"] =
      per_step / floor_seconds(arrays_read(kind), arrays_read(kind) - 1, count);
  state.counters["floor_GBps"] = static_cast<double>(bytes_per_param(kind)) * kTotal / floor / 1e9;
  if (double t = torch_seconds(kind, count); t > 0) {
    state.counters["speedup_vs_torch_optim"] = t / per_step;
    state.counters["torch_optim_ms"] = t * 1e3;
  }
  state.SetBytesProcessed(state.iterations() * bytes_per_param(kind) * kTotal);
  internal::fused_split() = saved;
}

// dtrain's fused step and ATen's own fused CPU kernel (what PyTorch's fused=True calls) on the
// same parameters and gradients in one process, step for step alternately, each with its own
// state: the kernels compared without allocation history, process or minute between them.
// Counters: dtrain_ms, aten_fused_ms and their ratio.
void BM_PairedWithAtenFused(benchmark::State& state, Kind kind) {
  const int64_t count = state.range(0);
  std::vector<at::Tensor> params = make_tensors(count);
  std::vector<at::Tensor> grads, m, v, steps;
  for (const auto& p : params) {
    grads.push_back(at::randn_like(p));
    m.push_back(at::zeros_like(p));
    v.push_back(at::zeros_like(p));
    steps.push_back(at::zeros({}, at::kFloat));
  }
  auto ours = make_ours(kind, params);
  auto aten = [&] {
    if (kind == Kind::kAdam) {
      at::_fused_adam_(params, grads, m, v, {}, steps, 1e-3, 0.9, 0.999, 0, 1e-8, false, false);
    } else {
      at::_fused_sgd_(params, grads, m, 0, 0.9, 1e-3, 0, false, false, false);
    }
  };
  if (kind == Kind::kSGDMomentum) {
    at::_fused_sgd_(params, grads, m, 0, 0.9, 1e-3, 0, false, false, /*is_first_step=*/true);
  } else {
    aten();
  }
  ours->step(grads);
  double ours_s = 0, aten_s = 0;
  auto time = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (auto _ : state) {
    ours_s += time([&] { ours->step(grads); });
    aten_s += time(aten);
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["dtrain_ms"] = ours_s / n * 1e3;
  state.counters["aten_fused_ms"] = aten_s / n * 1e3;
  state.counters["dtrain_over_aten"] = ours_s / aten_s;
}
void BM_AdamPairedWithAtenFused(benchmark::State& s) { BM_PairedWithAtenFused(s, Kind::kAdam); }
void BM_SGDMomentumPairedWithAtenFused(benchmark::State& s) {
  BM_PairedWithAtenFused(s, Kind::kSGDMomentum);
}
BENCHMARK(BM_AdamPairedWithAtenFused)->ArgName("tensors")->Arg(64)->Arg(1)->UseRealTime();
BENCHMARK(BM_SGDMomentumPairedWithAtenFused)->ArgName("tensors")->Arg(64)->Arg(1)->UseRealTime();

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

// Two variants of the Adam and SGD-momentum rows: the threads' work cut as before 2026-11-26 (one
// piece of the concatenated tensors per thread; now each thread takes a share of every tensor),
// and fused=True (ATen's own CPU fused kernel, PyTorch's fused=True; dtrain's kernel keeps
// PyTorch's default, single-tensor numerics).
#define DTRAIN_BM_VARIANT(name, kind, suffix, split, fused_true)         \
  void BM_##name##suffix(benchmark::State& state) {                      \
    BM_Functional(state, kind, internal::FusedSplit::split, fused_true); \
  }                                                                      \
  BENCHMARK(BM_##name##suffix)                                           \
      ->ArgName("tensors")                                               \
      ->Arg(64)                                                          \
      ->Arg(1)                                                           \
      ->Unit(benchmark::kMillisecond)                                    \
      ->UseRealTime()

DTRAIN_BM_VARIANT(SGDMomentum, Kind::kSGDMomentum, Concatenated, kConcatenated, false);
DTRAIN_BM_VARIANT(SGDMomentum, Kind::kSGDMomentum, FusedTrue, kEachTensor, true);
DTRAIN_BM_VARIANT(Adam, Kind::kAdam, Concatenated, kConcatenated, false);
DTRAIN_BM_VARIANT(Adam, Kind::kAdam, FusedTrue, kEachTensor, true);

}  // namespace
}  // namespace dtrain::optim

BENCHMARK_MAIN();
