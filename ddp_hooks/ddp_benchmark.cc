// ./bazelw run -c opt //ddp_hooks:ddp_benchmark
// DDP at world 2 (two benchmark threads with their own Gloo groups over loopback) on a
// parameter-heavy, FLOP-light MLP: 8 Linear(1024, 1024) layers (8.4M parameters, 32 MiB of
// gradients), batch 2 per rank. Rows (read the per-rank `ms` counter; the Time column of a
// threaded benchmark divides by both threads' iterations):
//   BM_DDPIteration   zero_grad + forward + backward through DDP (gradients averaged)
//   BM_Backward       the same without DDP (compute only)
//   BM_AllReduce      all-reduce of the same gradient bytes in 25 MiB buckets (communication only)
//   BM_DDPZeroStep    iteration + ZeroRedundancyOptimizer(Adam) step: overlap=0 steps after
//                     backward (ZeRO's own chunked step+broadcast), overlap=1 steps inside the
//                     DDP hook bucket by bucket (hook_with_zero_step), 4 MiB buckets
// overlap = DDP / max(backward, all-reduce): 1.0 is perfect overlap. PyTorch's DDP on the same
// model: bench/peers/ddp_pytorch.py.
#include <chrono>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include "comm/thread_world.h"
#include "comm/coalesced.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "ddp_hooks/zero_hook.h"
#include "optim/zero_redundancy_optimizer.h"

namespace dtrain::ddp {
namespace {

constexpr int kWorld = 2;


torch::nn::Sequential make_mlp() {
  torch::nn::Sequential mlp;
  for (int i = 0; i < 8; ++i) {
    mlp->push_back(torch::nn::Linear(1024, 1024));
    mlp->push_back(torch::nn::ReLU());
  }
  return mlp;
}

double elapsed_ms(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

void BM_DDPIteration(benchmark::State& state) {
  comm::Group& g = comm::thread_world_rank(state.thread_index(), kWorld);
  auto mlp = make_mlp();
  DDPOptions o;
  o.group = g;
  o.gradient_as_bucket_view = state.range(0) == 1;
  DistributedDataParallel ddp(mlp.ptr(), o);
  const torch::Tensor x = torch::randn({2, 1024});
  auto iteration = [&] {
    mlp->zero_grad();
    ddp.forward([&] { return mlp->forward(x).sum(); }).backward();
  };
  iteration();
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) iteration();
  state.counters["ms"] = elapsed_ms(start) / state.iterations() / kWorld;
}
BENCHMARK(BM_DDPIteration)->ArgName("bucket_view")->Arg(0)->Arg(1)->Threads(kWorld)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_Backward(benchmark::State& state) {
  auto mlp = make_mlp();
  const torch::Tensor x = torch::randn({2, 1024});
  auto iteration = [&] {
    mlp->zero_grad();
    mlp->forward(x).sum().backward();
  };
  iteration();
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) iteration();
  state.counters["ms"] = elapsed_ms(start) / state.iterations() / kWorld;
}
BENCHMARK(BM_Backward)->Threads(kWorld)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_AllReduce(benchmark::State& state) {
  comm::Group& g = comm::thread_world_rank(state.thread_index(), kWorld);
  auto mlp = make_mlp();
  std::vector<torch::Tensor> grads;
  for (const auto& p : mlp->parameters()) grads.push_back(torch::randn_like(p));
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) comm::all_reduce_coalesced(g, grads).wait();
  state.counters["ms"] = elapsed_ms(start) / state.iterations() / kWorld;
}
BENCHMARK(BM_AllReduce)->Threads(kWorld)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_DDPZeroStep(benchmark::State& state) {
  comm::Group& g = comm::thread_world_rank(state.thread_index(), kWorld);
  const bool overlap = state.range(0) == 1;
  auto mlp = make_mlp();
  DDPOptions o;
  o.group = g;
  o.gradient_as_bucket_view = true;
  o.bucket_cap_mb = 4;
  DistributedDataParallel ddp(mlp.ptr(), o);
  optim::OptionsDict adam = optim::new_options_dict();
  adam.insert("lr", 1e-4);
  optim::ZeroOptions zo;
  zo.group = g;
  zo.parameters_as_bucket_view = true;
  zo.overlap_with_ddp = overlap;
  optim::ZeroRedundancyOptimizer zero(
      mlp->parameters(), optim::local_optimizer<optim::FunctionalOptimizerAdapter>("Adam", adam), zo);
  if (overlap) ddp.register_comm_hook(hook_with_zero_step(std::make_unique<AllReduceHook>(g), ddp, zero));
  const torch::Tensor x = torch::randn({2, 1024});
  auto iteration = [&] {
    zero.zero_grad();
    ddp.forward([&] { return mlp->forward(x).sum(); }).backward();
    zero.step();
  };
  iteration();
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) iteration();
  state.counters["ms"] = elapsed_ms(start) / state.iterations() / kWorld;
  // Counters sum over the rank threads: per rank is the average.
  state.counters["state_MiB"] = static_cast<double>(zero.local_state_bytes()) / (1 << 20) / kWorld;
}
BENCHMARK(BM_DDPZeroStep)->ArgName("overlap")->Arg(0)->Arg(1)->Threads(kWorld)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace dtrain::ddp

BENCHMARK_MAIN();
