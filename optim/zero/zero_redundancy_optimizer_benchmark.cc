// ./bazelw run -c opt //optim/zero:zero_redundancy_optimizer_benchmark
// ZeroRedundancyOptimizer at world 2 (two benchmark threads, each with its own Gloo group over
// loopback), Adam on 20M fp32 parameters in two models:
//   model 0 "equal":    20 tensors of 1M parameters
//   model 1 "dominant": an embedding of 10M parameters + 10 tensors of 1M
// Configurations: 0 unsharded (every rank steps everything, no sync: plain data parallel),
// 1 sorted_greedy with per-parameter sync, 2 sorted_greedy with bucket views, 3 flat
// (element-granular ranges of one buffer). Local optimizer: the
// fused functional Adam through the adapter (the default way), or LibTorch's torch::optim::Adam.
// Counters: step_ms (wall time per step on each rank: the figure to compare; Google Benchmark's
// Time column for threaded runs divides by the iterations of both threads), state_MiB_per_rank (optimizer state on rank 0), state_balance (largest shard /
// ideal), consolidate_ms (consolidate_state_dict of the full state onto rank 0, once).
// PyTorch's ZeroRedundancyOptimizer on the same shapes: bench/peers/zero_pytorch.py.
#include <chrono>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/optim/adam.h>

#include "comm/testing/thread_world.h"
#include "optim/functional/adapter.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::optim {
namespace {

constexpr int kWorld = 2;
constexpr int64_t kM = int64_t{1} << 20;

std::vector<int64_t> model_sizes(int model) {
  if (model == 0) return std::vector<int64_t>(20, kM);
  std::vector<int64_t> s = {10 * kM};
  s.insert(s.end(), 10, kM);
  return s;
}

enum Config { kUnsharded = 0, kPerParam = 1, kBucketView = 2, kFlat = 3 };

void BM_Zero(benchmark::State& state) {
  const int model = static_cast<int>(state.range(0));
  const Config config = static_cast<Config>(state.range(1));
  const bool functional = state.range(2) == 0;
  comm::Group& g = comm::thread_world_rank(state.thread_index(), kWorld);
  std::vector<at::Tensor> params;
  for (int64_t n : model_sizes(model)) {
    params.push_back(at::full({n}, 0.5).requires_grad_());
    params.back().mutable_grad() = at::full({n}, 0.01);
  }
  OptionsDict adam = new_options_dict();
  adam.insert("lr", 1e-3);
  auto local = [&] {
    return functional ? local_optimizer<FunctionalOptimizerAdapter>("Adam", adam)
                      : local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3));
  };
  std::unique_ptr<torch::optim::Optimizer> opt;
  ZeroRedundancyOptimizer* zero = nullptr;
  if (config == kUnsharded) {
    LocalOptimizer l = local();
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(params, l.defaults->clone());
    opt = l.make(std::move(groups));
  } else {
    ZeroOptions o;
    o.group = g;
    o.parameters_as_bucket_view = config == kBucketView;
    if (config == kFlat) o.strategy = PartitionStrategy::kFlat;
    auto z = std::make_unique<ZeroRedundancyOptimizer>(params, local(), o);
    zero = z.get();
    opt = std::move(z);
  }
  opt->step();  // state allocation outside the timed loop
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) opt->step();
  const double step_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
      state.iterations();

  const double per_thread = 1.0 / kWorld;  // counters are summed over the rank threads
  // Each rank's own wall time per step (the Time column divides by both threads' iterations).
  state.counters["step_ms"] = per_thread * step_ms;
  int64_t total = 0;
  for (int64_t n : model_sizes(model)) total += n;
  if (zero != nullptr) {
    const auto& numel = zero->partition().numel_per_rank;
    state.counters["state_balance"] =
        per_thread * static_cast<double>(*std::max_element(numel.begin(), numel.end())) * kWorld /
        total;
    state.counters["state_MiB_per_rank"] =
        per_thread * static_cast<double>(zero->local_state_bytes()) / (1 << 20);
    const auto t0 = std::chrono::steady_clock::now();
    zero->consolidate_state_dict(0);
    state.counters["consolidate_ms"] =
        per_thread *
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  } else {
    state.counters["state_balance"] = per_thread * kWorld;  // every rank holds everything
    state.counters["state_MiB_per_rank"] = per_thread * static_cast<double>(total) * 8 / (1 << 20);
  }
}

// Args: model (0 equal, 1 dominant), config, local optimizer (0 functional Adam, 1 torch::optim::Adam).
BENCHMARK(BM_Zero)
    ->ArgNames({"model", "config", "torch_optim"})
    ->Args({0, kUnsharded, 0})
    ->Args({0, kPerParam, 0})
    ->Args({0, kBucketView, 0})
    ->Args({1, kUnsharded, 0})
    ->Args({1, kPerParam, 0})
    ->Args({1, kBucketView, 0})
    ->Args({0, kFlat, 0})
    ->Args({1, kFlat, 0})
    ->Args({0, kPerParam, 1})
    ->Args({0, kBucketView, 1})
    ->Threads(kWorld)
    ->UseRealTime()
    ->MinTime(2.0)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace dtrain::optim

BENCHMARK_MAIN();
