// ./bazelw run -c opt //ddp_hooks:ddp_benchmark
// DDP at world 2 (two benchmark threads with their own Gloo groups over loopback) on a
// parameter-heavy, FLOP-light MLP: 8 Linear(1024, 1024) layers (8.4M parameters, 32 MiB of
// gradients), batch 2 per rank. Rows (read the per-rank `ms` counter: the Time column of a
// threaded benchmark is counted differently by Debian 12's and Debian 13's Google Benchmark):
//   BM_DDPIteration   zero_grad + forward + backward through DDP (gradients averaged)
//   BM_DDPIterationZeroGrad  the same with zero_grad(set_to_none = 0 or 1) named
//   BM_Backward       the same without DDP (compute only)
//   BM_BackwardZeroGrad  backward alone after zero_grad(set_to_none = 0 or 1): what allocating
//                     the gradients afresh each iteration costs (2.x's default zero_grad())
//   BM_AllReduce      all-reduce of the same gradient bytes in 25 MiB buckets (communication only)
//   BM_Overlap        backward alone, communication alone and the DDP iteration timed in turn in
//                     every iteration; overlap = ddp / max(backward, comm). link_ms = 0: Gloo;
//                     link_ms > 0: a hook modelling communication that costs no CPU (a NIC doing
//                     the transfer): each bucket completes bytes / bandwidth after the link is
//                     free, gradients untouched, all gradients take link_ms. link_ms = 1 is the
//                     engine's own cost; 40 shows how much communication the engine hides behind
//                     backward when the transfer does not share the CPU (Gloo's copies here compete
//                     with both ranks' backward on two cores); 100 is link-bound (communication
//                     cannot start before the forward pass and the first bucket).
//   BM_DDPZeroStep    iteration + ZeroRedundancyOptimizer(Adam) step: overlap=0 steps after
//                     backward (ZeRO's own chunked step+broadcast), overlap=1 steps inside the
//                     DDP hook bucket by bucket once backward is done (hook_with_zero_step),
//                     overlap=2 interleaves the steps with backward
//                     (hook_with_zero_step_interleaved), overlap=3 is ZeRO-2 (hook_with_zero2:
//                     gradients reduce-scattered in backward, step + all-gather per bucket in
//                     step()); 4 MiB buckets; grad_MiB: gradient bytes a rank keeps for the step
// overlap = DDP / max(backward, all-reduce): 1.0 is perfect overlap. PyTorch's DDP on the same
// model: bench/peers/ddp_pytorch.py.
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include "comm/coalesced.h"
#include "comm/testing/thread_world.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "ddp_hooks/testing/benchmark_mlp.h"
#include "ddp_hooks/zero_hook.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::ddp_hooks {
namespace {

constexpr int kWorld = 2;

double elapsed_ms(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// zero_grad() with the LibTorch's own default (set_to_none < 0; 2.x: true, 1.13: false), or as named.
void ddp_iteration(benchmark::State& state, int set_to_none) {
  comm::Group& g = comm::thread_world_rank(state.thread_index(), kWorld);
  auto mlp = benchmark_mlp();
  DDPOptions o;
  o.group = g;
  o.gradient_as_bucket_view = state.range(0) == 1;
  o.bucket_cap_mb = static_cast<double>(state.range(1));
  DistributedDataParallel ddp(mlp.ptr(), o);
  const torch::Tensor x = torch::randn({2, 1024});
  auto iteration = [&] {
    if (set_to_none < 0) {
      mlp->zero_grad();
    } else {
      mlp->zero_grad(set_to_none != 0);
    }
    ddp.forward([&] { return mlp->forward(x).sum(); }).backward();
  };
  iteration();
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) iteration();
  state.counters["ms"] = elapsed_ms(start) / state.iterations() / kWorld;
}
void BM_DDPIteration(benchmark::State& state) { ddp_iteration(state, -1); }
BENCHMARK(BM_DDPIteration)
    ->ArgNames({"bucket_view", "cap_mb"})
    ->Args({0, 25})
    ->Args({1, 25})
    ->Args({1, 4})
    ->Threads(kWorld)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
// The same with zero_grad(set_to_none) named: 1 allocates every gradient afresh in each backward.
void BM_DDPIterationZeroGrad(benchmark::State& state) {
  ddp_iteration(state, static_cast<int>(state.range(2)));
}
BENCHMARK(BM_DDPIterationZeroGrad)
    ->ArgNames({"bucket_view", "cap_mb", "set_to_none"})
    ->Args({0, 25, 0})
    ->Args({0, 25, 1})
    ->Args({1, 25, 0})
    ->Args({1, 25, 1})
    ->Threads(kWorld)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_Backward(benchmark::State& state) {
  auto mlp = benchmark_mlp();
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

// Backward alone with the two kinds of zero_grad: set_to_none=1 frees every .grad, so each
// backward allocates the gradients again (LibTorch 2.x's default for Module::zero_grad()); 0 zeroes
// them in place (1.13's default). On this machine the two are within noise of each other: fresh
// gradients alone do not make an iteration slower. What does is glibc returning freed blocks to
// the kernel while DDP copies gradients into buckets (bench/comparison.md, notes: the copy-to-buckets
// row with and without MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_).
void BM_BackwardZeroGrad(benchmark::State& state) {
  const bool set_to_none = state.range(0) != 0;
  auto mlp = benchmark_mlp();
  const torch::Tensor x = torch::randn({2, 1024});
  auto iteration = [&] {
    mlp->zero_grad(set_to_none);
    mlp->forward(x).sum().backward();
  };
  iteration();
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) iteration();
  state.counters["ms"] = elapsed_ms(start) / state.iterations() / kWorld;
}
BENCHMARK(BM_BackwardZeroGrad)
    ->ArgName("set_to_none")
    ->Arg(0)
    ->Arg(1)
    ->Threads(kWorld)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_AllReduce(benchmark::State& state) {
  comm::Group& g = comm::thread_world_rank(state.thread_index(), kWorld);
  auto mlp = benchmark_mlp();
  std::vector<torch::Tensor> grads;
  for (const auto& p : mlp->parameters()) grads.push_back(torch::randn_like(p));
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) comm::all_reduce_coalesced(g, grads).wait();
  state.counters["ms"] = elapsed_ms(start) / state.iterations() / kWorld;
}
BENCHMARK(BM_AllReduce)->Threads(kWorld)->UseRealTime()->Unit(benchmark::kMillisecond);

// Buckets go over one modelled link in the order they are ready; a timer thread completes each
// future when its transfer would have ended, so the hook never blocks the autograd thread.
class OffCpuLinkHook : public c10d::CommHookInterface {
 public:
  explicit OffCpuLinkHook(double bytes_per_ms)
      : bytes_per_ms_(bytes_per_ms), timer_([this] { run(); }) {}
  ~OffCpuLinkHook() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    timer_.join();
  }

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    const at::Tensor buffer = bucket.getBuffer();
    const auto transfer = std::chrono::duration<double, std::milli>(
        static_cast<double>(buffer.numel() * buffer.element_size()) / bytes_per_ms_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      link_free_ = std::max(link_free_, std::chrono::steady_clock::now()) +
                   std::chrono::duration_cast<std::chrono::steady_clock::duration>(transfer);
      pending_.push_back({link_free_, fut, buffer});
    }
    cv_.notify_one();
    return fut;
  }
  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensor(); }

 private:
  struct Transfer {
    std::chrono::steady_clock::time_point done;
    c10::intrusive_ptr<c10::ivalue::Future> future;
    at::Tensor buffer;
  };
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !pending_.empty(); });
      if (stop_) return;
      Transfer t = std::move(pending_.front());
      pending_.pop_front();
      lock.unlock();
      std::this_thread::sleep_until(t.done);
      t.future->markCompleted(c10::IValue(t.buffer));
      lock.lock();
    }
  }
  const double bytes_per_ms_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Transfer> pending_;
  std::chrono::steady_clock::time_point link_free_;
  bool stop_ = false;
  std::thread timer_;
};

// Overlap efficiency without drift: every iteration times backward alone (a second copy of the
// model, no DDP), the communication alone and the DDP iteration back to back, so the ratio
// overlap = ddp / max(backward, comm) compares figures taken seconds apart (this machine's speed
// drifts up to 2x within minutes). link_ms = 0: Gloo all-reduce of the gradients in the same
// bucket sizes; link_ms > 0: the modelled off-CPU link taking link_ms for all gradients.
void BM_Overlap(benchmark::State& state) {
  comm::Group& g = comm::thread_world_rank(state.thread_index(), kWorld);
  const int64_t link_ms = state.range(0);
  const double cap_mb = static_cast<double>(state.range(1));
  auto mlp = benchmark_mlp();
  auto plain = benchmark_mlp();
  std::vector<torch::Tensor> grads;
  int64_t grad_bytes = 0;
  for (const auto& p : mlp->parameters()) {
    grads.push_back(torch::randn_like(p));
    grad_bytes += p.numel() * p.element_size();
  }
  DDPOptions o;
  o.group = g;
  o.gradient_as_bucket_view = true;
  o.bucket_cap_mb = cap_mb;
  DistributedDataParallel ddp(mlp.ptr(), o);
  if (link_ms > 0) {
    ddp.register_comm_hook(
        std::make_unique<OffCpuLinkHook>(static_cast<double>(grad_bytes) / link_ms));
  }
  const torch::Tensor x = torch::randn({2, 1024});
  auto backward = [&] {
    plain->zero_grad();
    plain->forward(x).sum().backward();
  };
  auto communicate = [&] {
    if (link_ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(link_ms));
    } else {
      comm::all_reduce_coalesced(g, grads, c10d::ReduceOp::SUM,
                                 static_cast<int64_t>(cap_mb * (1 << 20)))
          .wait();
    }
  };
  auto iteration = [&] {
    mlp->zero_grad();
    ddp.forward([&] { return mlp->forward(x).sum(); }).backward();
  };
  backward();
  communicate();
  iteration();
  // The modelled link does not synchronise the ranks: a barrier before each phase keeps both
  // ranks in the same phase, so each phase is timed with the other rank doing the same.
  auto barrier = [&] { g->barrier()->wait(); };
  double backward_ms = 0, comm_ms = 0, ddp_ms = 0;
  for (auto _ : state) {
    barrier();
    auto t = std::chrono::steady_clock::now();
    backward();
    backward_ms += elapsed_ms(t);
    barrier();
    t = std::chrono::steady_clock::now();
    communicate();
    comm_ms += elapsed_ms(t);
    barrier();
    t = std::chrono::steady_clock::now();
    iteration();
    ddp_ms += elapsed_ms(t);
  }
  // Counters sum over the rank threads: per rank is the average.
  const double n = static_cast<double>(state.iterations()) * kWorld;
  state.counters["backward_ms"] = backward_ms / n;
  state.counters["comm_ms"] = comm_ms / n;
  state.counters["ddp_ms"] = ddp_ms / n;
  state.counters["overlap"] = ddp_ms / std::max(backward_ms, comm_ms) / kWorld;
}
BENCHMARK(BM_Overlap)
    ->ArgNames({"link_ms", "cap_mb"})
    ->Args({0, 25})
    ->Args({0, 4})
    ->Args({1, 4})
    ->Args({40, 25})
    ->Args({40, 4})
    ->Args({100, 4})
    ->MinTime(3)
    ->Threads(kWorld)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_DDPZeroStep(benchmark::State& state) {
  comm::Group& g = comm::thread_world_rank(state.thread_index(), kWorld);
  const bool overlap = state.range(0) == 1 || state.range(0) == 2;
  const bool zero2 = state.range(0) == 3;
  auto mlp = benchmark_mlp();
  DDPOptions o;
  o.group = g;
  o.gradient_as_bucket_view = !zero2;
  o.bucket_cap_mb = 4;
  DistributedDataParallel ddp(mlp.ptr(), o);
  optim::ZeroOptions zo;
  zo.group = g;
  zo.parameters_as_bucket_view = true;
  zo.overlap_with_ddp = overlap;
  zo.shard_gradients = zero2;
  optim::ZeroRedundancyOptimizer zero(
      mlp->parameters(),
      optim::local_optimizer<optim::FunctionalOptimizerAdapter>("Adam", {{"lr", 1e-4}}), zo);
  if (state.range(0) == 1)
    ddp.register_comm_hook(hook_with_zero_step(std::make_unique<AllReduceHook>(g), ddp, zero));
  if (state.range(0) == 2) {
    ddp.register_comm_hook(
        hook_with_zero_step_interleaved(std::make_unique<AllReduceHook>(g), ddp, zero));
  }
  if (zero2) ddp.register_comm_hook(hook_with_zero2(ddp, zero));
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
  state.counters["grad_MiB"] = static_cast<double>(zero.gradient_bytes()) / (1 << 20) / kWorld;
}
BENCHMARK(BM_DDPZeroStep)
    ->ArgName("overlap")
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Arg(3)
    ->Threads(kWorld)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace dtrain::ddp_hooks

BENCHMARK_MAIN();
