// What PostLocalSGD's averaging costs per step, by world size and period: the model averagers of
// optim/model_averagers.h over ranks as threads (Gloo on loopback), a 4 MiB model in 16 tensors.
// Rows: PeriodicModelAverager at period 1 (every step: DDP's volume, the control row), 4 and 16;
// HierarchicalModelAverager (period 2 within pairs, period 8 across the world). Counters: the
// bytes each rank sends per step (comm/testing/counting_group.h's accounting), the parameters.
// Ranks share this machine's cores: compare rows of one run, not absolute times across machines.
//
//   ./bazelw run -c opt //optim:post_local_sgd_benchmark
#include <chrono>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include "comm/process_group.h"
#include "comm/testing/counting_group.h"
#include "comm/testing/test_harness.h"
#include "optim/model_averagers.h"

namespace dtrain::optim {
namespace {

constexpr int64_t kTensors = 16;
constexpr int64_t kElements = (4 << 20) / 4 / kTensors;  // 4 MiB of float32 in all
constexpr int kSteps = 16;

std::vector<at::Tensor> model(int rank) {
  std::vector<at::Tensor> params;
  for (int64_t i = 0; i < kTensors; ++i) {
    at::Tensor p = at::full({kElements}, static_cast<float>(rank + i));
    p.mutable_grad() = at::ones_like(p);  // only parameters with gradients are averaged
    params.push_back(p);
  }
  return params;
}

// Runs kSteps averager steps on every rank; the iteration's time is rank 0's mean step, from a
// barrier before the first step to one after the last.
template <typename MakeAverager>
void run(benchmark::State& state, int world, const MakeAverager& make) {
  int64_t bytes = 0;
  for (auto _ : state) {
    double seconds = 0;
    comm::testing::run_ranks_as_threads(world, [&](comm::Group& g) {
      auto counter = std::make_shared<comm::ByteCounter>();
      comm::Group counted = comm::counting_group(g, counter);
      std::unique_ptr<ModelAverager> averager = make(counted);
      std::vector<at::Tensor> params = model(g.rank());
      comm::barrier(g)->wait();
      const auto t0 = std::chrono::steady_clock::now();
      for (int s = 0; s < kSteps; ++s) averager->average_parameters(params);
      comm::barrier(g)->wait();
      if (g.rank() == 0) {
        seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        int64_t total = 0;
        for (const auto& [key, c] : counter->snapshot()) total += c.bytes;
        bytes = total / kSteps;
      }
    });
    state.SetIterationTime(seconds / kSteps);
  }
  state.counters["bytes_per_step"] = static_cast<double>(bytes);
  state.counters["params"] = static_cast<double>(kTensors * kElements);
}

void BM_PeriodicModelAverager(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const int64_t period = state.range(1);
  run(state, world, [&](comm::Group& g) {
    return std::make_unique<PeriodicModelAverager>(period, /*warmup_steps=*/0, g);
  });
}
BENCHMARK(BM_PeriodicModelAverager)
    ->ArgNames({"world", "period"})
    ->ArgsProduct({{2, 4, 8}, {1, 4, 16}})
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

void BM_HierarchicalModelAverager(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  run(state, world, [&](comm::Group& g) {
    return std::make_unique<HierarchicalModelAverager>(
        std::vector<std::pair<int64_t, int>>{{2, 2}, {8, world}}, /*warmup_steps=*/0, g);
  });
}
BENCHMARK(BM_HierarchicalModelAverager)
    ->ArgNames({"world"})
    ->Arg(4)
    ->Arg(8)
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace dtrain::optim

BENCHMARK_MAIN();
