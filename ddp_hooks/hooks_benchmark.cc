// ./bazelw run -c opt //ddp_hooks:hooks_benchmark
// Each communication hook on 80 MiB of fp32 gradients in transformer-like shapes (four 2048x2048
// matrices, eight 1024x640 matrices, 2048 biases), cut into 25 MiB buckets as DDP would, at
// world 2 (benchmark threads with their own Gloo groups). Counters: `ms` per rank for all
// buckets, `sent_MiB` per rank and `compression` (raw bytes / bytes sent). BM_RawAllReduce is the
// plain all-reduce of the same bytes without any hook.
#include <chrono>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include "comm/testing/thread_world.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/libtorch_compat.h"
#include "ddp_hooks/powersgd_hook.h"

namespace dtrain::ddp_hooks {
namespace {

constexpr int kWorld = 2;

struct Buckets {
  std::vector<at::Tensor> params;
  struct One {
    at::Tensor buffer;
    std::vector<size_t> offsets, lengths;
    std::vector<c10::IntArrayRef> sizes;
    std::vector<at::Tensor> params;
  };
  std::vector<One> buckets;
  int64_t bytes = 0;
};

Buckets make_buckets() {
  Buckets b;
  for (int i = 0; i < 4; ++i) b.params.push_back(at::randn({2048, 2048}));
  for (int i = 0; i < 8; ++i) b.params.push_back(at::randn({1024, 640}));
  for (int i = 0; i < 8; ++i) b.params.push_back(at::randn({2048}));
  const int64_t cap = int64_t{25} << 20;
  int64_t in_bucket = cap;
  for (auto& p : b.params) {
    const int64_t bytes = p.numel() * 4;
    if (in_bucket + bytes > cap && in_bucket > 0) {
      b.buckets.emplace_back();
      in_bucket = 0;
    }
    auto& one = b.buckets.back();
    one.offsets.push_back(one.offsets.empty() ? 0 : one.offsets.back() + one.lengths.back());
    one.lengths.push_back(static_cast<size_t>(p.numel()));
    one.sizes.push_back(p.sizes());
    one.params.push_back(p);
    in_bucket += bytes;
    b.bytes += bytes;
  }
  for (auto& one : b.buckets)
    one.buffer = at::randn({static_cast<int64_t>(one.offsets.back() + one.lengths.back())});
  return b;
}

enum Kind { kAllReduce, kFp16, kBf16, kPowerSGD1, kPowerSGD4, kNoOp };

void BM_Hook(benchmark::State& state) {
  comm::Group& g = comm::thread_world_rank(state.thread_index(), kWorld);
  const Kind kind = static_cast<Kind>(state.range(0));
  Buckets b = make_buckets();
  std::unique_ptr<c10d::CommHookInterface> hook;
  std::shared_ptr<PowerSGDState> psgd;
  switch (kind) {
    case kAllReduce:
      hook = std::make_unique<AllReduceHook>(g);
      break;
    case kFp16:
      hook = std::make_unique<CompressHook>(g, at::kHalf);
      break;
    case kBf16:
      hook = std::make_unique<CompressHook>(g, at::kBFloat16);
      break;
    case kPowerSGD1:
    case kPowerSGD4:
      psgd = std::make_shared<PowerSGDState>(g);
      psgd->matrix_approximation_rank = kind == kPowerSGD1 ? 1 : 4;
      psgd->start_powerSGD_iter = 2;
      psgd->iter = 2;  // compress from the first measured call
      hook = std::make_unique<PowerSGDHook>(psgd);
      break;
    case kNoOp:
      hook = std::make_unique<NoOpHook>();
      break;
  }
  auto run = [&] {
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    for (size_t k = 0; k < b.buckets.size(); ++k) {
      auto& one = b.buckets[k];
      c10d::GradBucket gb = make_grad_bucket(k, b.buckets.size(), one.buffer, one.offsets,
                                             one.lengths, one.sizes, one.params);
      futures.push_back(hook->runHook(gb));
    }
    for (auto& f : futures) {
      f->wait();
      if (f->hasError()) throw std::runtime_error(f->tryRetrieveErrorMessage());
    }
  };
  try {
    run();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    for (auto _ : state) {
    }
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) run();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
      state.iterations();
  double sent = static_cast<double>(b.bytes);
  if (kind == kFp16 || kind == kBf16) sent /= 2;
  if (psgd) sent = static_cast<double>(b.bytes) / psgd->compression_rate();
  if (kind == kNoOp) sent = 0;
  state.counters["ms"] = ms / kWorld;  // counters are summed over the rank threads
  state.counters["sent_MiB"] = sent / (1 << 20) / kWorld;
  state.counters["compression"] = (sent > 0 ? static_cast<double>(b.bytes) / sent : 0) / kWorld;
}
BENCHMARK(BM_Hook)
    ->ArgName("hook")  // 0 allreduce, 1 fp16, 2 bf16, 3 PowerSGD rank 1, 4 PowerSGD rank 4, 5 noop
    ->DenseRange(0, 5)
    ->Threads(kWorld)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_RawAllReduce(benchmark::State& state) {
  comm::Group& g = comm::thread_world_rank(state.thread_index(), kWorld);
  std::vector<at::Tensor> t = {at::randn({int64_t{20} << 20})};  // 80 MiB
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) g->allreduce(t)->wait();
  state.counters["ms"] =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
      state.iterations() / kWorld;
}
BENCHMARK(BM_RawAllReduce)->Threads(kWorld)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace dtrain::ddp_hooks

BENCHMARK_MAIN();
