// DDP, every hook, ZeRO-1/2 (overlap too) and PostLocalSGD with CUDA parameters (tags = ["gpu"];
// comm/testing/gpu_testing.h): two ranks over Gloo sharing the one GPU, each run against the same run on
// the CPU (which the CPU suites hold to PyTorch's numerics). One GPU cannot host two NCCL ranks;
// NCCL's paths are in comm:collectives_gpu_test at world size 1 and in the NCCL case here.
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/testing/gpu_testing.h"
#include "comm/testing/test_harness.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/powersgd_hook.h"
#include "ddp_hooks/testing/embedding_mlp.h"
#include "ddp_hooks/zero_hook.h"
#include "optim/model_averagers.h"
#include "optim/post_local_sgd_optimizer.h"

namespace dtrain::ddp_hooks {
namespace {

using comm::testing::run_ranks_as_threads;
using optim::FunctionalOptimizerAdapter;
using optim::local_optimizer;
using optim::ZeroOptions;
using optim::ZeroRedundancyOptimizer;

constexpr int kBatch = 8;
constexpr int kSteps = 6;

struct NetImpl : EmbeddingMlpImpl {
  NetImpl() : EmbeddingMlpImpl(/*vocab=*/40, /*dim=*/8, /*hidden=*/16, /*out=*/3) {}
};
TORCH_MODULE(Net);

Net make_net(const torch::Device& device) {
  Net net;
  {
    torch::NoGradGuard no_grad;
    int k = 0;
    for (auto& p : net->parameters())
      p.copy_(torch::sin(torch::arange(p.numel()).view(p.sizes()) * 0.3 + k++) * 0.5);
  }
  net->to(device);
  return net;
}

enum class Kind {
  kAllReduce,
  kFp16,
  kBf16,
  kPowerSGD,
  kZero1,
  kZero2,
  kZeroOverlap,
  kPostLocalSGD
};
std::string name(Kind k) {
  const char* n[] = {"allreduce", "fp16",  "bf16",         "powersgd",
                     "zero1",     "zero2", "zero_overlap", "post_local_sgd"};
  return n[static_cast<int>(k)];
}

// ~100 ms of matrix products queued on the current stream of the GPU.
void queue_busy_work(const torch::Device& cuda) {
  torch::Tensor a = torch::rand({2048, 2048}, cuda), b = torch::rand({2048, 2048}, cuda) / 2048;
  for (int i = 0; i < 40; ++i) a = torch::tanh(torch::mm(a, b));
}

// Rank `g.rank()`'s parameters (on the CPU) after kSteps steps of `kind` with the model on `device`.
// With `side_stream`, every step runs on a stream from the pool, queued behind busy work: a hook
// that issued its collectives on any other stream would read its buckets before they were filled.
std::vector<torch::Tensor> train(comm::Group& g, Kind kind, const torch::Device& device,
                                 bool side_stream = false) {
  std::optional<c10::StreamGuard> on_side_stream;
  if (side_stream) {
    on_side_stream.emplace(
        c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device, false));
  }
  Net net = make_net(device);
  DDPOptions d;
  d.group = g;
  d.bucket_cap_mb = d.first_bucket_cap_mb = 0.0005;  // several buckets
  DistributedDataParallel ddp(net.ptr(), d);
  optim::OptionsDict adam = optim::new_options_dict();
  adam.insert("lr", 0.01);
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  std::unique_ptr<torch::optim::Optimizer> plain;
  if (kind == Kind::kZero1 || kind == Kind::kZero2 || kind == Kind::kZeroOverlap) {
    ZeroOptions zo;
    zo.group = g;
    zo.shard_gradients = kind == Kind::kZero2;
    zo.overlap_with_ddp = kind == Kind::kZeroOverlap;
    zero = std::make_unique<ZeroRedundancyOptimizer>(
        net->parameters(), local_optimizer<FunctionalOptimizerAdapter>("Adam", adam), zo);
    if (kind == Kind::kZero2) ddp.register_comm_hook(hook_with_zero2(ddp, *zero));
    if (kind == Kind::kZeroOverlap) {
      ddp.register_comm_hook(hook_with_zero_step(std::make_unique<AllReduceHook>(g), ddp, *zero));
    }
  } else {
    plain = std::make_unique<FunctionalOptimizerAdapter>(net->parameters(), "Adam", adam);
  }
  if (kind == Kind::kFp16) ddp.register_comm_hook(std::make_unique<CompressHook>(g, at::kHalf));
  if (kind == Kind::kBf16) ddp.register_comm_hook(std::make_unique<CompressHook>(g, at::kBFloat16));
  if (kind == Kind::kPowerSGD) {
    auto state = std::make_shared<PowerSGDState>(g);
    state->start_powerSGD_iter = 2;
    state->min_compression_rate = 1;
    ddp.register_comm_hook(std::make_unique<PowerSGDHook>(state));
  }
  if (kind == Kind::kPostLocalSGD) {
    auto state = std::make_shared<PostLocalSGDState>(g, g, /*start_localSGD_iter=*/2);
    ddp.register_comm_hook(std::make_unique<PostLocalSGDHook>(state));
    plain = std::make_unique<optim::PostLocalSGDOptimizer>(
        std::move(plain), std::make_shared<optim::PeriodicModelAverager>(2, 2, g));
  }
  for (int s = 0; s < kSteps; ++s) {
    const torch::Tensor x =
        ((torch::arange(kBatch, torch::kLong) * 7 + s * 5 + g.rank() * 3) % 40).to(device);
    const torch::Tensor y =
        torch::sin(torch::arange(kBatch * 3, torch::kFloat).view({kBatch, 3}) + s + g.rank())
            .to(device);
    if (plain) plain->zero_grad();
    if (zero) zero->zero_grad();
    if (side_stream) queue_busy_work(device);
    ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
    if (zero && kind != Kind::kZeroOverlap) {
      zero->clip_grad_norm_(1.0);
      zero->step();
    }
    if (plain) plain->step();
  }
  if (zero) {
    zero->consolidate_state_dict(0);
    if (g.rank() == 0) {
      c10::IValue sd = zero->state_dict();
      EXPECT_TRUE(sd.isGenericDict());
    }
  }
  std::vector<torch::Tensor> out;
  for (auto& p : net->parameters()) {
    EXPECT_EQ(p.device(), device) << name(kind);
    out.push_back(p.detach().cpu());
  }
  return out;
}

class DdpOnGpuTest : public ::testing::TestWithParam<Kind> {};

// Ranks as processes: one process's autograd engine has one thread per device, and two ranks'
// backward passes on that one thread would wait on each other's reductions (one process per
// GPU rank is also how PyTorch runs).
TEST_P(DdpOnGpuTest, CudaParametersTrainAsOnTheCpu) {
  DTRAIN_GPU_TEST_OR_SKIP();
  const Kind kind = GetParam();
  comm::testing::run_ranks_as_processes(2, [&](comm::Group& g) {
    const std::vector<torch::Tensor> cpu = train(g, kind, torch::kCPU);
    const std::vector<torch::Tensor> cuda = train(g, kind, torch::Device(torch::kCUDA, 0));
    // fp16/bf16 round the same values on both devices; cuBLAS and CPU BLAS sum in different orders.
    const double tol = kind == Kind::kBf16                              ? 2e-2
                       : kind == Kind::kFp16 || kind == Kind::kPowerSGD ? 2e-3
                                                                        : 1e-4;
    for (size_t i = 0; i < cpu.size(); ++i) {
      EXPECT_TRUE(torch::allclose(cuda[i], cpu[i], tol, tol))
          << name(kind) << " rank " << g.rank() << " parameter " << i << ": max difference "
          << (cuda[i] - cpu[i]).abs().max().item<double>();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Hooks, DdpOnGpuTest,
                         ::testing::Values(Kind::kAllReduce, Kind::kFp16, Kind::kBf16,
                                           Kind::kPowerSGD, Kind::kZero1, Kind::kZero2,
                                           Kind::kZeroOverlap, Kind::kPostLocalSGD),
                         [](const auto& info) { return name(info.param); });

// Hooks run their chains on a worker thread (ddp_hooks/internal/ordered_worker.h), which must issue
// them on the stream backward ran on: here a side stream, behind ~100 ms of kernels every step.
class HookStreamTest : public ::testing::TestWithParam<Kind> {};

TEST_P(HookStreamTest, HooksRunOnTheCallersStream) {
  DTRAIN_GPU_TEST_OR_SKIP();
  const Kind kind = GetParam();
  comm::testing::run_ranks_as_processes(2, [&](comm::Group& g) {
    const torch::Device cuda(torch::kCUDA, 0);
    const std::vector<torch::Tensor> plain = train(g, kind, cuda);
    const std::vector<torch::Tensor> side = train(g, kind, cuda, /*side_stream=*/true);
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_TRUE(torch::allclose(side[i], plain[i], 1e-5, 1e-5))
          << name(kind) << " rank " << g.rank() << " parameter " << i << ": max difference "
          << (side[i] - plain[i]).abs().max().item<double>();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Chained, HookStreamTest,
                         ::testing::Values(Kind::kAllReduce, Kind::kPowerSGD, Kind::kZero2,
                                           Kind::kZeroOverlap),
                         [](const auto& info) { return name(info.param); });

// NCCL at world size 1: DDP and ZeRO construct (their agreement checks run on the GPU) and train.
TEST(DdpOnGpuTest, NcclWorldOfOneTrainsDdpAndZero) {
  DTRAIN_GPU_TEST_OR_SKIP();
  std::vector<torch::Tensor> cpu, cuda;
  run_ranks_as_threads(1, [&](comm::Group& g) { cpu = train(g, Kind::kZero1, torch::kCPU); }, {});
  run_ranks_as_threads(
      1, [&](comm::Group& g) { cuda = train(g, Kind::kZero1, g.device()); },
      comm::testing::with_backend("nccl"));
  for (size_t i = 0; i < cpu.size(); ++i)
    EXPECT_TRUE(torch::allclose(cuda[i], cpu[i], 1e-4, 1e-4)) << i;
}

// Stream order: ~100 ms of matrix products are queued before the forward on the current stream;
// the gradient reduction must wait for them, so gradients equal a run without them.
TEST(DdpOnGpuTest, ReductionWaitsForKernelsQueuedBeforeBackward) {
  DTRAIN_GPU_TEST_OR_SKIP();
  comm::testing::run_ranks_as_processes(2, [&](comm::Group& g) {
    std::vector<torch::Tensor> grads, slow;
    for (bool busy : {false, true}) {
      const torch::Device cuda(torch::kCUDA, 0);
      Net net = make_net(cuda);
      DDPOptions d;
      d.group = g;
      DistributedDataParallel ddp(net.ptr(), d);
      torch::Tensor x = ((torch::arange(kBatch, torch::kLong) * 3 + g.rank()) % 40).to(cuda);
      if (busy) queue_busy_work(cuda);
      ddp.forward([&] { return net->forward(x).square().mean(); }).backward();
      for (auto& p : net->parameters()) (busy ? slow : grads).push_back(p.grad().cpu());
    }
    for (size_t i = 0; i < grads.size(); ++i)
      EXPECT_TRUE(torch::equal(grads[i], slow[i])) << "rank " << g.rank() << " " << i;
  });
}

}  // namespace
}  // namespace dtrain::ddp_hooks
