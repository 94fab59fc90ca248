// The seed's post-local SGD example end to end (torch.distributed.optim docs, PostLocalSGDOptimizer):
// DDP with post_localSGD_hook(start_localSGD_iter = W) and PostLocalSGDOptimizer(SGD,
// PeriodicModelAverager(period = 4, warmup_steps = W)), on 4 ranks in 2 "nodes" of 2. Each rank
// trains on its own data, so the replicas' parameters are:
//   - before W: equal on every rank at every step (DDP all-reduces the gradients globally);
//   - from W on: equal within a node at every step (gradients all-reduced in the subgroup), and
//     equal across the nodes exactly at the averaging steps (W, W + 4, ...), nowhere else.
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "comm/process_group.h"
#include "comm/testing/test_harness.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "optim/model_averagers.h"
#include "optim/post_local_sgd_optimizer.h"

namespace dtrain::ddp_hooks {
namespace {

// True when every rank of `g` holds the same bytes in `flat`.
bool equal_on(comm::Group& g, const at::Tensor& flat) {
  std::vector<at::Tensor> mine = {flat.clone()};
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < g.size(); ++r) all[0].push_back(at::empty_like(flat));
  g->allgather(all, mine)->wait();
  for (int r = 1; r < g.size(); ++r) {
    if (!all[0][r].equal(all[0][0])) return false;
  }
  return true;
}

constexpr int64_t kWarmup = 6, kPeriod = 4, kSteps = 20;

TEST(PostLocalSGDSeedTest, ReplicasAgreeWhereTheSeedSaysTheyDo) {
  comm::testing::run_ranks_as_threads(4, [](comm::Group& world) {
    absl::StatusOr<comm::Subgroups> nodes = comm::new_subgroups(world, 2);
    ASSERT_TRUE(nodes.ok()) << nodes.status();
    torch::nn::Linear model(6, 3);
    {
      torch::NoGradGuard no_grad;
      model->weight.copy_(at::sin(at::arange(18, at::kFloat).view({3, 6})));
      model->bias.copy_(at::cos(at::arange(3, at::kFloat)));
    }
    DDPOptions o;
    o.group = world;
    DistributedDataParallel ddp(model.ptr(), o);
    auto state = std::make_shared<PostLocalSGDState>(world, nodes->mine, kWarmup);
    ddp.register_comm_hook(std::make_unique<PostLocalSGDHook>(state));
    optim::PostLocalSGDOptimizer opt(
        std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.01)),
        std::make_shared<optim::PeriodicModelAverager>(kPeriod, kWarmup, world));
    for (int64_t step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      const at::Tensor x =
          at::sin(at::arange(24, at::kFloat).view({4, 6}) * 0.3 + step + 1.7 * world.rank());
      const at::Tensor y =
          at::cos(at::arange(12, at::kFloat).view({4, 3}) + step * 0.1 + world.rank());
      ddp.forward([&] { return torch::nn::functional::mse_loss(model->forward(x), y); }).backward();
      opt.step();
      const at::Tensor flat = at::cat({model->weight.detach().reshape(-1), model->bias.detach()});
      const bool averaged = step >= kWarmup && (step - kWarmup) % kPeriod == 0;
      EXPECT_TRUE(equal_on(nodes->mine, flat))
          << "step " << step << ": replicas differ within a node";
      EXPECT_EQ(equal_on(world, flat), step < kWarmup || averaged) << "step " << step;
    }
  });
}

}  // namespace
}  // namespace dtrain::ddp_hooks
