// ./bazelw run -c opt //partition:partition_benchmark
// Partition time for 100k parameters (sizes drawn like a transformer's: many small, some large)
// at world sizes 2..1024, and the imbalance each algorithm leaves (max rank / ideal).
#include <random>

#include <benchmark/benchmark.h>

#include "partition/bucket_assignment.h"
#include "partition/flat_partition.h"
#include "partition/sorted_greedy.h"

namespace dtrain::partition {
namespace {

const std::vector<int64_t>& param_sizes() {
  static const std::vector<int64_t> sizes = [] {
    std::mt19937 rng(42);
    std::vector<int64_t> s(100000);
    for (auto& n : s) {
      // 1-D biases and norms (small) mixed with matrices (large).
      n = (rng() % 4 == 0) ? int64_t{64} * (1 + rng() % 4096)
                           : 1 + static_cast<int64_t>(rng() % 4096);
    }
    return s;
  }();
  return sizes;
}

int64_t total(const std::vector<int64_t>& s) {
  int64_t t = 0;
  for (auto n : s) t += n;
  return t;
}

void BM_SortedGreedy(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const std::vector<std::vector<int64_t>> groups = {param_sizes()};
  int64_t max_numel = 0;
  for (auto _ : state) {
    auto p = sorted_greedy_partition(groups, world);
    max_numel = p->max_numel();
    benchmark::DoNotOptimize(p);
  }
  state.counters["max_over_ideal"] = static_cast<double>(max_numel) * world / total(param_sizes());
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(param_sizes().size()));
}
BENCHMARK(BM_SortedGreedy)->RangeMultiplier(2)->Range(2, 1024)->Unit(benchmark::kMillisecond);

void BM_FlatPartition(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  int64_t max_size = 0;
  for (auto _ : state) {
    auto fp = flat_partition(param_sizes(), world, /*alignment=*/16);
    max_size = fp->ranges[0].size();
    benchmark::DoNotOptimize(fp);
  }
  state.counters["max_over_ideal"] = static_cast<double>(max_size) * world / total(param_sizes());
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(param_sizes().size()));
}
BENCHMARK(BM_FlatPartition)->RangeMultiplier(2)->Range(2, 1024)->Unit(benchmark::kMillisecond);

void BM_ShardedBucketAssignment(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  // 25 MB buckets of fp32 parameters, as DDP builds them.
  std::vector<std::vector<int64_t>> buckets(1);
  int64_t bytes = 0;
  for (int64_t n : param_sizes()) {
    if (bytes + 4 * n > 25 * 1024 * 1024 && !buckets.back().empty()) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(n);
    bytes += 4 * n;
  }
  int64_t max_numel = 0;
  for (auto _ : state) {
    auto bp = assign_ddp_buckets(buckets, world, /*shard_buckets=*/true);
    if (!bp.ok()) {
      state.SkipWithError(std::string(bp.status().message()).c_str());
      return;
    }
    max_numel = *std::max_element(bp->numel_per_rank.begin(), bp->numel_per_rank.end());
    benchmark::DoNotOptimize(bp);
  }
  state.counters["buckets"] = static_cast<double>(buckets.size());
  state.counters["max_over_ideal"] = static_cast<double>(max_numel) * world / total(param_sizes());
}
BENCHMARK(BM_ShardedBucketAssignment)
    ->RangeMultiplier(2)
    ->Range(2, 64)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace dtrain::partition

BENCHMARK_MAIN();
