// NCCL across processes, one GPU each (tags = ["gpu"]): two ranks as processes on cuda:0 and
// cuda:1 (LOCAL_RANK) through the collectives, object collectives, DDP with the allreduce and
// PowerSGD hooks and ZeRO-2, each against the same run on the CPU over Gloo. Needs two GPUs: with
// fewer every case skips, saying "needs 2 GPUs" (bench/gpu/run_on_gpu counts that skip as a pass).
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "comm/object_collectives.h"
#include "comm/testing/gpu_testing.h"
#include "comm/testing/test_harness.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/powersgd_hook.h"
#include "ddp_hooks/zero_hook.h"

namespace dtrain::ddp_hooks {
namespace {

#define DTRAIN_NEEDS_TWO_GPUS()                                                  \
  DTRAIN_GPU_TEST_OR_SKIP();                                                     \
  if (torch::cuda::device_count() < 2) {                                         \
    GTEST_SKIP() << "needs 2 GPUs (NCCL refuses two ranks on one device); "      \
                 << static_cast<int>(torch::cuda::device_count()) << " visible"; \
  }

TEST(NcclTwoGpusTest, CollectivesOnEachRanksOwnGpu) {
  DTRAIN_NEEDS_TWO_GPUS();
  comm::testing::run_ranks_as_processes(
      2,
      [](comm::Group& g) {
        EXPECT_EQ(g.device(), torch::Device(torch::kCUDA, g.rank()));
        std::vector<torch::Tensor> t = {torch::full({1 << 16}, g.rank() + 1.0, g.device())};
        g->allreduce(t)->wait();
        EXPECT_EQ(t[0].min().item<float>(), 3.0f);
        auto all = comm::all_gather_object(g, c10::IValue(int64_t{10 + g.rank()}));
        ASSERT_TRUE(all.ok()) << all.status();
        EXPECT_EQ((*all)[1].toInt(), 11);
        auto at0 = comm::gather_object(g, c10::IValue(std::string(g.rank() == 0 ? "a" : "b")), 0);
        ASSERT_TRUE(at0.ok()) << at0.status();
        if (g.rank() == 0) EXPECT_EQ((*at0)[1].toStringRef(), "b");
      },
      comm::testing::with_backend("nccl"));
}

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

enum class Kind { kAllReduce, kPowerSGD, kZero2 };

std::vector<torch::Tensor> train(comm::Group& g, Kind kind) {
  torch::manual_seed(3);
  Net net;
  net->to(g.device());
  DDPOptions d;
  d.group = g;
  d.bucket_cap_mb = d.first_bucket_cap_mb = 0.001;
  DistributedDataParallel ddp(net.ptr(), d);
  optim::OptionsDict adam = optim::new_options_dict();
  adam.insert("lr", 0.01);
  optim::ZeroOptions zo;
  zo.group = g;
  zo.shard_gradients = kind == Kind::kZero2;
  optim::ZeroRedundancyOptimizer zero(
      net->parameters(), optim::local_optimizer<optim::FunctionalOptimizerAdapter>("Adam", adam),
      zo);
  if (kind == Kind::kZero2) ddp.register_comm_hook(hook_with_zero2(ddp, zero));
  if (kind == Kind::kPowerSGD) {
    auto state = std::make_shared<PowerSGDState>(g);
    state->start_powerSGD_iter = 2;
    state->min_compression_rate = 1;
    ddp.register_comm_hook(std::make_unique<PowerSGDHook>(state));
  }
  for (int s = 0; s < 5; ++s) {
    torch::Tensor x =
        torch::sin(torch::arange(48, torch::kFloat).view({8, 6}) + s + g.rank()).to(g.device());
    zero.zero_grad();
    ddp.forward([&] { return net->forward(x).square().mean(); }).backward();
    zero.step();
  }
  std::vector<torch::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.detach().cpu());
  return out;
}

// One run_ranks_as_processes per test (its children re-run the test up to that call).
class NcclTwoGpusDdpTest : public ::testing::TestWithParam<Kind> {};

TEST_P(NcclTwoGpusDdpTest, MatchesTheCpuRun) {
  DTRAIN_NEEDS_TWO_GPUS();
  const Kind kind = GetParam();
  std::vector<std::vector<torch::Tensor>> cpu(2);
  comm::testing::run_ranks_as_threads(2, [&](comm::Group& g) { cpu[g.rank()] = train(g, kind); });
  comm::testing::run_ranks_as_processes(
      2,
      [&](comm::Group& g) {
        const std::vector<torch::Tensor> cuda = train(g, kind);
        for (size_t i = 0; i < cuda.size(); ++i) {
          EXPECT_TRUE(torch::allclose(cuda[i], cpu[g.rank()][i], 2e-3, 2e-3))
              << static_cast<int>(kind) << " " << i;
        }
      },
      comm::testing::with_backend("nccl"));
}

INSTANTIATE_TEST_SUITE_P(Hooks, NcclTwoGpusDdpTest,
                         ::testing::Values(Kind::kAllReduce, Kind::kPowerSGD, Kind::kZero2));

}  // namespace
}  // namespace dtrain::ddp_hooks
