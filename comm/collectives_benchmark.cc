// ./bazelw run -c opt //comm:collectives_benchmark
// c10d collectives at world 2 (two ranks as benchmark threads, each with its own Gloo process
// group over TCP loopback), 4 KiB .. 64 MiB, reported as nccl-tests does:
//   size   allreduce/broadcast: the buffer; allgather: the gathered output; reduce_scatter: input
//   algbw  size / time
//   busbw  algbw * 2(n-1)/n (allreduce), 1 (broadcast), (n-1)/n (allgather, reduce_scatter)
//   op_us  each rank's wall time per collective (read this, not the Time column, which for a
//          threaded benchmark divides by the iterations of both threads)
#include <chrono>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include "comm/process_group.h"
#include "comm/testing/thread_world.h"

namespace dtrain::comm {
namespace {

constexpr int kWorld = 2;

enum class Op { kAllReduce, kBroadcast, kAllGather, kReduceScatter };

double bus_factor(Op op) {
  const double n = kWorld;
  switch (op) {
    case Op::kAllReduce:
      return 2 * (n - 1) / n;
    case Op::kBroadcast:
      return 1;
    default:
      return (n - 1) / n;
  }
}

template <Op op>
void BM_Collective(benchmark::State& state) {
  Group& g = thread_world_rank(state.thread_index(), kWorld);
  const int64_t bytes = state.range(0);
  const int64_t numel = bytes / 4;
  const int64_t shard = numel / kWorld;
  std::vector<at::Tensor> buf;
  std::vector<std::vector<at::Tensor>> lists(1);
  if (op == Op::kAllReduce || op == Op::kBroadcast) {
    buf = {at::ones({numel})};
  } else {
    buf = {at::ones({shard})};
    for (int r = 0; r < kWorld; ++r) lists[0].push_back(at::empty({shard}));
  }
  auto run = [&] {
    switch (op) {
      case Op::kAllReduce:
        g->allreduce(buf)->wait();
        break;
      case Op::kBroadcast:
        g->broadcast(buf)->wait();
        break;
      case Op::kAllGather:
        g->allgather(lists, buf)->wait();
        break;
      case Op::kReduceScatter:
        g->reduce_scatter(buf, lists)->wait();
        break;
    }
  };
  if (op == Op::kReduceScatter) {
    try {
      run();
    } catch (const std::exception& e) {
      // Both ranks fail the same way without communicating (Gloo in LibTorch 1.13 lacks it).
      state.SkipWithError((g->getBackendName() + " has no reduce_scatter").c_str());
      for (auto _ : state) {
      }
      return;
    }
  }
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) run();
  const double op_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() /
      state.iterations();
  const double per_thread = 1.0 / kWorld;  // counters are summed over the two rank threads
  // Each rank's wall time per collective: the figure to read (the Time column of a threaded run
  // divides by the iterations of both threads).
  state.counters["op_us"] = per_thread * op_us;
  state.counters["algbw"] =
      benchmark::Counter(static_cast<double>(bytes) * state.iterations() * per_thread,
                         benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
  state.counters["busbw"] = benchmark::Counter(
      bus_factor(op) * static_cast<double>(bytes) * state.iterations() * per_thread,
      benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
}

#define DTRAIN_COLLECTIVE(name, op)                                \
  void name(benchmark::State& state) { BM_Collective<op>(state); } \
  BENCHMARK(name)                                                  \
      ->RangeMultiplier(4)                                         \
      ->Range(4 << 10, 64 << 20)                                   \
      ->Threads(kWorld)                                            \
      ->UseRealTime()                                              \
      ->Unit(benchmark::kMicrosecond)

DTRAIN_COLLECTIVE(BM_AllReduce, Op::kAllReduce);
DTRAIN_COLLECTIVE(BM_Broadcast, Op::kBroadcast);
DTRAIN_COLLECTIVE(BM_AllGather, Op::kAllGather);
DTRAIN_COLLECTIVE(BM_ReduceScatter, Op::kReduceScatter);

}  // namespace
}  // namespace dtrain::comm

BENCHMARK_MAIN();
