// ./bazelw run -c opt //optim/functional:state_precision_benchmark
// AdamW's step with its state in float32 (dtrain's fused kernel and ATen's fused kernel, what
// PyTorch's fused=True runs), bfloat16 and 8 bits, on 16M float32 parameters as 64 tensors and as
// 1 tensor, in one process, step for step in turn (each with its own state), so that every row
// sees the same machine in the same second. Counters:
//   fp32_ms, aten_fused_ms, bf16_ms, q8_ms      mean step time of each
//   bf16_over_fp32, q8_over_fp32                 against dtrain's float32 step (goal <= 0.75, 0.6)
//   bf16_over_aten, q8_over_aten                 against ATen's fused float32 step
//   *_floor_ratio                                step time / the time to stream the bytes the step
//                                                moves (parameter r/w, gradient r, state r/w) at
//                                                this run's best streaming rate (floor_GBps)
//   rem_f32_ms, rem_bf16_ms, rem_q8_ms           the same parameters in bfloat16 with
//                                                param_remainders (an exact float32 master in
//                                                parameter + int16 remainder), bfloat16 gradients,
//                                                float32 / bfloat16 / 8-bit state
//   rem_f32_over_fp32, rem_bf16_over_bf16,       against float32 parameters with that state
//   rem_q8_over_q8
//   rem_q8_bytes_per_param                       what stays in memory per parameter there:
//                                                parameter + remainder + gradient + state
#include <algorithm>
#include <chrono>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include "optim/functional/adam.h"
#include "optim/functional/state_precision.h"

namespace dtrain::optim {
namespace {

constexpr int64_t kTotal = int64_t{16} << 20;

template <typename F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The best rate (bytes/s) at which this machine streams an array read and written in place plus
// one read-only array, with at::parallel_for's threads: the mix of an optimizer step.
double stream_rate() {
  at::Tensor a = at::randn({kTotal}), b = at::randn({kTotal});
  float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  double best = 1e30;
  for (int r = 0; r < 10; ++r) {
    best = std::min(best, seconds([&] {
                      at::parallel_for(0, kTotal, int64_t{1} << 16, [&](int64_t lo, int64_t hi) {
                        for (int64_t k = lo; k < hi; ++k) pa[k] = 0.5f * pa[k] + pb[k];
                      });
                    }));
  }
  return 12.0 * kTotal / best;
}

// Bytes one AdamW step moves per parameter: parameter read and written, gradient read, the two
// moments read and written at their precision (8-bit: codes plus a float scale per 256).
double bytes_per_param(StateDtype dtype) {
  switch (dtype) {
    case StateDtype::kParam:
      return 4 * 2 + 4 + 2 * 4 * 2;
    case StateDtype::kBFloat16:
      return 4 * 2 + 4 + 2 * 2 * 2;
    case StateDtype::k8Bit:
      return 4 * 2 + 4 + 2 * (1 + 4.0 / kQuantBlock) * 2;
  }
  return 0;
}

// Bytes that stay in memory for `opt`'s parameters: parameters, `grads`, every state tensor but
// "step" (for param_remainders, the remainders among them).
double resident_bytes(const FunctionalAdamW& opt, const std::vector<at::Tensor>& grads) {
  double bytes = 0;
  for (size_t i = 0; i < grads.size(); ++i) bytes += opt.params()[i].nbytes() + grads[i].nbytes();
  for (const auto& kv : opt.state_dict().toGenericDict().at("state").toGenericDict()) {
    for (const auto& slot : kv.value().toGenericDict()) {
      if (slot.key().toStringRef() != "step") bytes += slot.value().toTensor().nbytes();
    }
  }
  return bytes;
}

void BM_AdamWStatePrecision(benchmark::State& state) {
  const int64_t count = state.range(0);
  std::vector<at::Tensor> params, grads, m, v, steps;
  for (int64_t i = 0; i < count; ++i) {
    params.push_back(at::randn({kTotal / count}));
    grads.push_back(at::randn({kTotal / count}));
    m.push_back(at::zeros({kTotal / count}));
    v.push_back(at::zeros({kTotal / count}));
    steps.push_back(at::zeros({}, at::kFloat));
  }
  FunctionalAdamW fp32(params, AdamWOptions());
  FunctionalAdamW bf16(params, AdamWOptions().state_dtype(std::string(kStateBFloat16)));
  FunctionalAdamW q8(params, AdamWOptions().state_dtype(std::string(kState8Bit)));
  std::vector<at::Tensor> bf16_params, bf16_grads;
  for (int64_t i = 0; i < count; ++i) {
    bf16_params.push_back(params[i].to(at::kBFloat16));
    bf16_grads.push_back(grads[i].to(at::kBFloat16));
  }
  std::vector<at::Tensor> bf16_params_q8 = bf16_params, bf16_params_f32 = bf16_params;
  for (auto& p : bf16_params_q8) p = p.clone();
  for (auto& p : bf16_params_f32) p = p.clone();
  FunctionalAdamW rem_bf16(bf16_params,
                           AdamWOptions().param_remainders(true).state_dtype(kStateBFloat16));
  FunctionalAdamW rem_q8(bf16_params_q8,
                         AdamWOptions().param_remainders(true).state_dtype(kState8Bit));
  FunctionalAdamW rem_f32(bf16_params_f32, AdamWOptions().param_remainders(true));
  auto aten = [&] {
    at::_fused_adamw_(params, grads, m, v, {}, steps, 1e-3, 0.9, 0.999, 1e-2, 1e-8, false, false);
  };
  fp32.step(grads);  // state allocated outside the timed loop
  bf16.step(grads);
  q8.step(grads);
  rem_bf16.step(bf16_grads);
  rem_q8.step(bf16_grads);
  rem_f32.step(bf16_grads);
  aten();
  double t_fp32 = 0, t_aten = 0, t_bf16 = 0, t_q8 = 0, t_rem_bf16 = 0, t_rem_q8 = 0, t_rem_f32 = 0;
  for (auto _ : state) {
    t_fp32 += seconds([&] { fp32.step(grads); });
    t_aten += seconds(aten);
    t_bf16 += seconds([&] { bf16.step(grads); });
    t_q8 += seconds([&] { q8.step(grads); });
    t_rem_bf16 += seconds([&] { rem_bf16.step(bf16_grads); });
    t_rem_q8 += seconds([&] { rem_q8.step(bf16_grads); });
    t_rem_f32 += seconds([&] { rem_f32.step(bf16_grads); });
  }
  const double n = static_cast<double>(state.iterations());
  const double rate = stream_rate();
  auto floor = [&](StateDtype d) { return bytes_per_param(d) * kTotal / rate; };
  state.counters["fp32_ms"] = t_fp32 / n * 1e3;
  state.counters["aten_fused_ms"] = t_aten / n * 1e3;
  state.counters["bf16_ms"] = t_bf16 / n * 1e3;
  state.counters["q8_ms"] = t_q8 / n * 1e3;
  state.counters["bf16_over_fp32"] = t_bf16 / t_fp32;
  state.counters["q8_over_fp32"] = t_q8 / t_fp32;
  state.counters["bf16_over_aten"] = t_bf16 / t_aten;
  state.counters["q8_over_aten"] = t_q8 / t_aten;
  state.counters["fp32_floor_ratio"] = t_fp32 / n / floor(StateDtype::kParam);
  state.counters["bf16_floor_ratio"] = t_bf16 / n / floor(StateDtype::kBFloat16);
  state.counters["q8_floor_ratio"] = t_q8 / n / floor(StateDtype::k8Bit);
  state.counters["floor_GBps"] = rate / 1e9;
  state.counters["rem_bf16_ms"] = t_rem_bf16 / n * 1e3;
  state.counters["rem_q8_ms"] = t_rem_q8 / n * 1e3;
  state.counters["rem_f32_ms"] = t_rem_f32 / n * 1e3;
  state.counters["rem_f32_over_fp32"] = t_rem_f32 / t_fp32;
  state.counters["rem_bf16_over_bf16"] = t_rem_bf16 / t_bf16;
  state.counters["rem_q8_over_q8"] = t_rem_q8 / t_q8;
  state.counters["rem_q8_bytes_per_param"] = resident_bytes(rem_q8, bf16_grads) / kTotal;
}
BENCHMARK(BM_AdamWStatePrecision)->ArgName("tensors")->Arg(64)->Arg(1)->UseRealTime();

}  // namespace
}  // namespace dtrain::optim

BENCHMARK_MAIN();
