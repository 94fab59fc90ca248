// ./bazelw run -c opt //rpc:rpc_benchmark
// RPC on TensorPipe over loopback, workers as threads of this process, each with its own agent
// (real sockets between them). Rows (per-call wall time in the `us` / `ms` counters):
//   BM_EmptyCall               round trip of a call with an empty body to a no-op handler
//   BM_GradientPush/<MiB>      GradientContext::send of one fp32 gradient of 1..64 MiB, then
//                              release (two round trips; GiB/s of gradient bytes)
//   BM_DistributedOptimizerStep  Adam step of a DistributedOptimizer over 2 owners x 100
//                              parameters of 1024 floats, gradients already in the context
// PyTorch's DistributedOptimizer on the same shapes: bench/peers/rpc_pytorch.py.
#include <chrono>
#include <thread>

#include <benchmark/benchmark.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "rpc/agent.h"
#include "rpc/distributed_optimizer.h"
#include "rpc/remote.h"

namespace dtrain::rpc {
namespace {

// Three workers for the whole run: "trainer" (the benchmark thread) and two owners.
struct Cluster {
  Cluster() {
    auto store = c10::make_intrusive<c10d::HashStore>();
    const std::vector<std::string> names = {"trainer", "ps1", "ps2"};
    std::vector<std::thread> threads;
    agents.resize(3);
    for (int r = 0; r < 3; ++r) {
      handlers.push_back(std::make_shared<Handlers>());
      owners.push_back(std::make_unique<ParameterOwner>(handlers.back()));
    }
    handlers[1]->add("noop", [](Request&) { return Reply{}; });
    for (int r = 0; r < 3; ++r) {
      threads.emplace_back([&, r] {
        AgentOptions o;
        o.name = names[r];
        o.rank = r;
        o.world_size = 3;
        o.store = store;
        o.handlers = handlers[r];
        o.num_worker_threads = 4;
        agents[r] = std::move(*Agent::create(o));
      });
    }
    for (auto& t : threads) t.join();
  }
  std::vector<std::shared_ptr<Handlers>> handlers;
  std::vector<std::unique_ptr<ParameterOwner>> owners;
  std::vector<std::unique_ptr<Agent>> agents;
};

Cluster& cluster() {
  static Cluster* c = new Cluster();  // lives until exit; agents are shut down by the OS
  return *c;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void BM_EmptyCall(benchmark::State& state) {
  Agent& a = *cluster().agents[0];
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (!a.rpc_sync("ps1", "noop", Writer()).ok()) state.SkipWithError("call failed");
  }
  state.counters["us"] = ms_since(t0) * 1e3 / state.iterations();
}
BENCHMARK(BM_EmptyCall)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_GradientPush(benchmark::State& state) {
  Agent& a = *cluster().agents[0];
  const int64_t numel = state.range(0) * (1 << 20) / 4;
  RemoteRef ref = *remote_parameter(a, "ps1", at::zeros({numel}));
  const at::Tensor grad = at::ones({numel});
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    GradientContext ctx(a);
    if (!ctx.send({ref}, {grad}).ok()) state.SkipWithError("push failed");
    (void)ctx.release();
  }
  const double ms = ms_since(t0) / state.iterations();
  state.counters["ms"] = ms;
  state.counters["GiBps"] = static_cast<double>(numel * 4) / (1 << 30) / (ms / 1e3);
  state.SetBytesProcessed(state.iterations() * numel * 4);
}
BENCHMARK(BM_GradientPush)
    ->ArgName("MiB")
    ->Arg(1)
    ->Arg(4)
    ->Arg(16)
    ->Arg(64)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_DistributedOptimizerStep(benchmark::State& state) {
  Agent& a = *cluster().agents[0];
  std::vector<RemoteRef> refs;
  std::vector<at::Tensor> grads;
  for (int owner = 1; owner <= 2; ++owner) {
    for (int i = 0; i < 100; ++i) {
      refs.push_back(*remote_parameter(a, owner == 1 ? "ps1" : "ps2", at::zeros({1024})));
      grads.push_back(at::full({1024}, 0.01));
    }
  }
  optim::OptionsDict adam = optim::new_options_dict();
  adam.insert("lr", 1e-3);
  auto opt = DistributedOptimizer::create(a, "Adam", adam, refs);
  GradientContext ctx(a);
  if (!opt.ok() || !ctx.send(refs, grads).ok()) {
    state.SkipWithError("setup failed");
    return;
  }
  (void)(*opt)->step(ctx.id());
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (!(*opt)->step(ctx.id()).ok()) state.SkipWithError("step failed");
  }
  state.counters["ms"] = ms_since(t0) / state.iterations();
}
BENCHMARK(BM_DistributedOptimizerStep)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace dtrain::rpc

BENCHMARK_MAIN();
