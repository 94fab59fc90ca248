// ./bazelw run -c opt //ddp_hooks:ddp_cuda_benchmark   (a CUDA GPU; without one it prints
// "skipped: no CUDA device" and exits 0)
// DDP on one GPU: an NCCL group of world size 1 (made once, on an in-process HashStore), an MLP of
// 8 x Linear(1792, 1792) with tanh (25.7M fp32 parameters, 103 MB of gradients), batch 256, on
// cuda:0. Every iteration ends with torch::cuda::synchronize() (real time, ms). Rows:
//   BM_CudaForwardBackward  zero_grad + forward + backward, no DDP: the floor
//   BM_CudaDdpIteration     the same through DistributedDataParallel (default all-reduce hook,
//                           bucket_cap_mb 25)
//   BM_CudaDdpAdamStep      DDP iteration + FunctionalOptimizerAdapter("Adam") step (ATen's fused
//                           kernel, dtrain's default on CUDA)
//   BM_CudaDdpZeroStep      DDP iteration + ZeroRedundancyOptimizer(Adam) step
//   BM_CudaDdpZeroOverlap   DDP with hook_with_zero_step around the all-reduce hook: the Adam step
//                           runs inside the hook, bucket by bucket (no zero.step())
// Counters:
//   overhead_vs_fwd_bwd     this row's time / BM_CudaForwardBackward's in this process (the last
//                           run of that row; measured here when a filter left it out)
//   fwd_bwd_ms              that floor
// At world size 1 the all-reduce moves no data between GPUs: the rows show what the engine,
// its hooks and the optimizers cost on top of compute. PyTorch on the same model, group and batch:
// bench/peers/ddp_cuda_peer.py.
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <utility>

#include <benchmark/benchmark.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/process_group.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "ddp_hooks/zero_hook.h"
#include "optim/functional/adapter.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::ddp_hooks {
namespace {

constexpr int kLayers = 8;
constexpr int64_t kWidth = 1792;
constexpr int64_t kBatch = 256;
constexpr int kWarmup = 3;  // untimed iterations per run (cuBLAS, allocator, optimizer state)
constexpr int kFloorIterations = 20;  // when BM_CudaForwardBackward did not run in this process
constexpr double kLr = 1e-4;

torch::Device cuda0() { return torch::Device(torch::kCUDA, 0); }

// The world-size-1 NCCL group, made on first use and kept until main() drops it (after the
// benchmarks, while CUDA is still up, rather than during static destruction).
std::unique_ptr<comm::Group>& nccl_world_slot() {
  static std::unique_ptr<comm::Group> slot;
  return slot;
}

comm::Group& nccl_world() {
  std::unique_ptr<comm::Group>& slot = nccl_world_slot();
  if (!slot) {
    comm::InitOptions o;
    o.backend = "nccl";
    o.store = c10::make_intrusive<c10d::HashStore>();
    o.rank = 0;
    o.world_size = 1;
    o.device_id = 0;
    auto group = comm::init_process_group(o);
    if (!group.ok()) {
      std::cerr << "ddp_cuda_benchmark: NCCL group of world size 1 on cuda:0: " << group.status()
                << "\n";
      std::exit(1);
    }
    slot = std::make_unique<comm::Group>(*std::move(group));
  }
  return *slot;
}

torch::nn::Sequential cuda_mlp() {
  torch::manual_seed(0);
  torch::nn::Sequential mlp;
  for (int i = 0; i < kLayers; ++i) {
    mlp->push_back(torch::nn::Linear(kWidth, kWidth));
    mlp->push_back(torch::nn::Tanh());
  }
  mlp->to(cuda0());
  return mlp;
}

torch::Tensor cuda_input() {
  return torch::randn({kBatch, kWidth}, torch::TensorOptions().device(cuda0()));
}

DDPOptions ddp_options() {
  DDPOptions o;
  o.group = nccl_world();
  o.bucket_cap_mb = 25;
  return o;
}

// Mean seconds of the benchmark's iterations of `iteration`, each followed by a device
// synchronisation, after kWarmup untimed ones.
template <typename F>
double timed_seconds(benchmark::State& state, F&& iteration) {
  for (int i = 0; i < kWarmup; ++i) iteration();
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    iteration();
    torch::cuda::synchronize();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
         static_cast<double>(state.iterations());
}

// BM_CudaForwardBackward's time per iteration in this process (< 0: not measured yet).
double& fwd_bwd_cache() {
  static double seconds = -1;
  return seconds;
}

// The floor for the counters: BM_CudaForwardBackward's last run, or measured here once
// (kFloorIterations after kWarmup) when a filter left that row out.
double fwd_bwd_seconds() {
  double& cached = fwd_bwd_cache();
  if (cached > 0) return cached;
  auto mlp = cuda_mlp();
  const torch::Tensor x = cuda_input();
  auto iteration = [&] {
    mlp->zero_grad();
    mlp->forward(x).sum().backward();
  };
  for (int i = 0; i < kWarmup; ++i) iteration();
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kFloorIterations; ++i) {
    iteration();
    torch::cuda::synchronize();
  }
  cached = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
           kFloorIterations;
  return cached;
}

void report(benchmark::State& state, double seconds) {
  const double floor = fwd_bwd_seconds();
  state.counters["overhead_vs_fwd_bwd"] = seconds / floor;
  state.counters["fwd_bwd_ms"] = floor * 1e3;
}

void BM_CudaForwardBackward(benchmark::State& state) {
  auto mlp = cuda_mlp();
  const torch::Tensor x = cuda_input();
  const double seconds = timed_seconds(state, [&] {
    mlp->zero_grad();
    mlp->forward(x).sum().backward();
  });
  fwd_bwd_cache() = seconds;  // each run overwrites: the last is the one reported
  report(state, seconds);
}

void BM_CudaDdpIteration(benchmark::State& state) {
  auto mlp = cuda_mlp();
  const torch::Tensor x = cuda_input();
  DistributedDataParallel ddp(mlp.ptr(), ddp_options());
  const double seconds = timed_seconds(state, [&] {
    mlp->zero_grad();
    ddp.forward([&] { return mlp->forward(x).sum(); }).backward();
  });
  report(state, seconds);
}

void BM_CudaDdpAdamStep(benchmark::State& state) {
  auto mlp = cuda_mlp();
  const torch::Tensor x = cuda_input();
  DistributedDataParallel ddp(mlp.ptr(), ddp_options());
  optim::OptionsDict adam = optim::new_options_dict();
  adam.insert("lr", kLr);
  optim::FunctionalOptimizerAdapter opt(mlp->parameters(), "Adam", adam);
  const double seconds = timed_seconds(state, [&] {
    opt.zero_grad();
    ddp.forward([&] { return mlp->forward(x).sum(); }).backward();
    opt.step();
  });
  report(state, seconds);
}

// overlap = false: ZeRO's own step after backward; true: hook_with_zero_step.
void zero_row(benchmark::State& state, bool overlap) {
  comm::Group& g = nccl_world();
  auto mlp = cuda_mlp();
  const torch::Tensor x = cuda_input();
  DistributedDataParallel ddp(mlp.ptr(), ddp_options());
  optim::ZeroOptions zo;
  zo.group = g;
  zo.overlap_with_ddp = overlap;
  optim::ZeroRedundancyOptimizer zero(
      mlp->parameters(),
      optim::local_optimizer<optim::FunctionalOptimizerAdapter>("Adam", {{"lr", kLr}}), zo);
  if (overlap)
    ddp.register_comm_hook(hook_with_zero_step(std::make_unique<AllReduceHook>(g), ddp, zero));
  const double seconds = timed_seconds(state, [&] {
    zero.zero_grad();
    ddp.forward([&] { return mlp->forward(x).sum(); }).backward();
    if (!overlap) zero.step();  // with the hook, backward already stepped every parameter
  });
  report(state, seconds);
}
void BM_CudaDdpZeroStep(benchmark::State& state) { zero_row(state, /*overlap=*/false); }
void BM_CudaDdpZeroOverlap(benchmark::State& state) { zero_row(state, /*overlap=*/true); }

BENCHMARK(BM_CudaForwardBackward)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaDdpIteration)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaDdpAdamStep)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaDdpZeroStep)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaDdpZeroOverlap)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace dtrain::ddp_hooks

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::cout << "skipped: no CUDA device" << std::endl;
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  dtrain::ddp_hooks::nccl_world_slot().reset();  // NCCL torn down while CUDA is still up
  return 0;
}
