#include "ddp_hooks/zero_hook.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/join.h"
#include "comm/object_collectives.h"
#include "comm/testing/test_harness.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/testing/fill_sin.h"
#include "ddp_hooks/testing/three_layer_mlp.h"

namespace dtrain::ddp_hooks {
namespace {

using comm::testing::run_ranks_as_threads;
using optim::FunctionalOptimizerAdapter;
using optim::local_optimizer;
using optim::ZeroOptions;
using optim::ZeroRedundancyOptimizer;
using ::testing::HasSubstr;

struct NetImpl : ThreeLayerMlpImpl {
  NetImpl() : ThreeLayerMlpImpl(/*in=*/4, /*h1=*/8, /*h2=*/6, /*out=*/3) {}
};
TORCH_MODULE(Net);

Net make_net() {
  Net net;
  fill_sin(*net, 0.5);
  return net;
}

torch::Tensor batch_x(int step) {
  return torch::cos(torch::arange(32, torch::kFloat).view({8, 4}) * 0.7 + step);
}
torch::Tensor batch_y() { return torch::sin(torch::arange(24, torch::kFloat).view({8, 3})); }

optim::LocalOptimizer adam() {
  optim::OptionsDict o = optim::new_options_dict();
  o.insert("lr", 0.01);
  o.insert("weight_decay", 0.01);
  return local_optimizer<FunctionalOptimizerAdapter>("Adam", o);
}

// One process, the whole batch, torch::optim::Adam: what every rank must hold after each step.
std::vector<std::vector<torch::Tensor>> reference(int steps) {
  Net net = make_net();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(0.01).weight_decay(0.01));
  std::vector<std::vector<torch::Tensor>> out;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    torch::mse_loss(net->forward(batch_x(s)), batch_y()).backward();
    opt.step();
    out.emplace_back();
    for (auto& p : net->parameters()) out.back().push_back(p.detach().clone());
  }
  return out;
}

struct Case {
  double bucket_cap_mb;
  bool shard_buckets;
  bool zero_bucket_view;
  bool ddp_bucket_view;
  bool torch_local =
      false;  // local_optimizer<torch::optim::Adam>: converted to its functional twin
};

std::unique_ptr<ZeroOverlapHook> make_hook(comm::Group& g, const DistributedDataParallel& ddp,
                                           ZeroRedundancyOptimizer& zero, bool shard_buckets,
                                           ZeroStepSchedule schedule) {
  return std::make_unique<ZeroOverlapHook>(std::make_unique<AllReduceHook>(g), ddp, zero,
                                           shard_buckets, schedule);
}

// ZeRO over a DDP group with overlap_with_ddp, and DDP with buckets of `cap_mb` (0: the default).
ZeroOptions overlap_options(comm::Group& g) {
  ZeroOptions zo;
  zo.group = g;
  zo.overlap_with_ddp = true;
  return zo;
}
DDPOptions ddp_options(comm::Group& g, double cap_mb = 0) {
  DDPOptions d;
  d.group = g;
  if (cap_mb > 0) {
    d.bucket_cap_mb = cap_mb;
    d.first_bucket_cap_mb = cap_mb;
  }
  return d;
}

// Steps [from, to) of this rank's half of the batch through DDP (the hook steps ZeRO).
void train(Net& net, DistributedDataParallel& ddp, ZeroRedundancyOptimizer& zero, comm::Group& g,
           int from, int to) {
  for (int s = from; s < to; ++s) {
    zero.zero_grad();
    torch::Tensor x = batch_x(s).narrow(0, 4 * g.rank(), 4),
                  y = batch_y().narrow(0, 4 * g.rank(), 4);
    ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
  }
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

void check_matches_unsharded_adam(const Case& c, ZeroStepSchedule schedule) {
  constexpr int kSteps = 6;
  const auto expected = reference(kSteps);
  run_ranks_as_threads(2, [&](comm::Group& g) {
    Net net = make_net();
    DDPOptions d;
    d.group = g;
    d.bucket_cap_mb = c.bucket_cap_mb;
    d.first_bucket_cap_mb = c.bucket_cap_mb;
    d.gradient_as_bucket_view = c.ddp_bucket_view;
    DistributedDataParallel ddp(net.ptr(), d);
    ZeroOptions zo;
    zo.group = g;
    zo.overlap_with_ddp = true;
    zo.parameters_as_bucket_view = c.zero_bucket_view;
    ZeroRedundancyOptimizer zero(net->parameters(),
                                 c.torch_local
                                     ? local_optimizer<torch::optim::Adam>(
                                           torch::optim::AdamOptions(0.01).weight_decay(0.01))
                                     : adam(),
                                 zo);
    auto hook = make_hook(g, ddp, zero, c.shard_buckets, schedule);
    const size_t buckets = hook->bucket_params().size();
    if (c.bucket_cap_mb < 1e-5) {
      EXPECT_EQ(buckets, 6u);  // one parameter per bucket
    }
    ddp.register_comm_hook(std::move(hook));
    // Both ranks own state: the partition follows the buckets.
    EXPECT_GT(zero.partition().numel_per_rank[0], 0);
    EXPECT_GT(zero.partition().numel_per_rank[1], 0);
    for (int s = 0; s < kSteps; ++s) {
      zero.zero_grad();
      torch::Tensor x = batch_x(s).narrow(0, 4 * g.rank(), 4),
                    y = batch_y().narrow(0, 4 * g.rank(), 4);
      ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
      // The parameters were updated during backward; step() must not update them again, and a
      // closure is not evaluated (PyTorch warns and returns None).
      EXPECT_FALSE(zero.step().defined());
      int closure_calls = 0;
      EXPECT_FALSE(zero.step([&] {
                         ++closure_calls;
                         return torch::ones({});
                       })
                       .defined());
      EXPECT_EQ(closure_calls, 0);
      auto params = net->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(params[i].allclose(expected[s][i], 1e-5, 1e-6))
            << "rank " << g.rank() << " step " << s << " param " << i << " max diff "
            << (params[i] - expected[s][i]).abs().max().item<float>();
      }
    }
    EXPECT_GT(zero.local_state_bytes(), 0);
  });
}

class ZeroOverlapScheduleTest : public ::testing::TestWithParam<ZeroStepSchedule> {};

TEST_P(ZeroOverlapScheduleTest, OneParameterPerBucketMatchesUnshardedAdam) {
  check_matches_unsharded_adam({1e-6, false, false, false}, GetParam());
}

TEST_P(ZeroOverlapScheduleTest, BucketViewsOnBothSidesMatchUnshardedAdam) {
  check_matches_unsharded_adam({1e-6, false, true, true}, GetParam());
}

TEST_P(ZeroOverlapScheduleTest, ShardedBucketSlicesMatchUnshardedAdam) {
  // 209-byte buckets: {fc3, fc2} (75 elements, above the 57.5 threshold: cut into two slices
  // owned by different ranks) and {fc1} (40 elements).
  check_matches_unsharded_adam({0.0002, true, true, false}, GetParam());
}

TEST_P(ZeroOverlapScheduleTest, ShardedSmallBucketsMatchUnshardedAdam) {
  check_matches_unsharded_adam({0.0001, true, false, true}, GetParam());
}

// PyTorch converts a torch.optim local optimizer to its functional twin; so does dtrain.
TEST_P(ZeroOverlapScheduleTest, TorchOptimAdamIsConvertedToItsFunctionalTwin) {
  check_matches_unsharded_adam({1e-6, false, false, false, /*torch_local=*/true}, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Schedules, ZeroOverlapScheduleTest,
                         ::testing::Values(ZeroStepSchedule::kAfterBackward,
                                           ZeroStepSchedule::kInterleaved),
                         [](const auto& info) {
                           return info.param == ZeroStepSchedule::kAfterBackward
                                      ? "HookWithZeroStep"
                                      : "HookWithZeroStepInterleaved";
                         });

TEST(ZeroOverlapHookTest, MisuseIsAClearError) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    Net net = make_net();
    DDPOptions d;
    d.group = g;
    DistributedDataParallel ddp(net.ptr(), d);
    auto message = error_of;
    ZeroOptions plain;
    plain.group = g;
    ZeroRedundancyOptimizer not_overlapped(net->parameters(), adam(), plain);
    EXPECT_THAT(message([&] {
                  ZeroOverlapHook(std::make_unique<AllReduceHook>(g), ddp, not_overlapped, false,
                                  ZeroStepSchedule::kAfterBackward);
                }),
                HasSubstr("overlap_with_ddp = true"));
    ZeroOptions zo = plain;
    zo.overlap_with_ddp = true;
    EXPECT_THAT(message([&] {
                  ZeroRedundancyOptimizer z(
                      net->parameters(),
                      local_optimizer<torch::optim::LBFGS>(torch::optim::LBFGSOptions(0.1)), zo);
                }),
                HasSubstr("needs a functional local optimizer"));
    // One 115-element bucket cannot be cut into 2 slices below 57.5 elements (PyTorch asserts).
    ZeroRedundancyOptimizer sharded(net->parameters(), adam(), zo);
    EXPECT_THAT(message([&] {
                  ZeroOverlapHook(std::make_unique<AllReduceHook>(g), ddp, sharded, true,
                                  ZeroStepSchedule::kAfterBackward);
                }),
                HasSubstr("needs more than 2 slices below the threshold"));
    auto params = net->parameters();
    params.pop_back();
    ZeroRedundancyOptimizer partial(params, adam(), zo);
    EXPECT_THAT(
        message([&] {
          ZeroOverlapHook(std::make_unique<AllReduceHook>(g), ddp, partial, false,
                          ZeroStepSchedule::kInterleaved);
        }),
        HasSubstr("DDP parameter 'fc3.bias' is not a parameter of the ZeroRedundancyOptimizer"));
  });
}

// Inside a Join a joined rank's shadow reductions would step the optimizer with zero gradients:
// both DDP (whose hook is the overlap hook) and the overlapped optimizer refuse, on every rank.
TEST(ZeroOverlapHookTest, JoinIsRefusedOnEveryRank) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    Net net = make_net();
    DistributedDataParallel ddp(net.ptr(), ddp_options(g));
    const ZeroOptions zo = overlap_options(g);
    ZeroRedundancyOptimizer zero(net->parameters(), adam(), zo);
    ddp.register_comm_hook(hook_with_zero_step(std::make_unique<AllReduceHook>(g), ddp, zero));
    EXPECT_THAT(error_of([&] { comm::Join join({&ddp}); }),
                HasSubstr("DistributedDataParallel cannot join: the ZeRO "
                          "overlap hook steps the optimizer"));
    EXPECT_THAT(error_of([&] { comm::Join join({&zero}); }),
                HasSubstr("overlap_with_ddp cannot join"));
  });
}

// A parameter frozen after the hook was registered: the next step raises, as PyTorch's.
TEST(ZeroOverlapHookTest, ATrainabilityChangeIsAnError) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    Net net = make_net();
    DDPOptions d = ddp_options(g);
    d.find_unused_parameters = true;
    DistributedDataParallel ddp(net.ptr(), d);
    const ZeroOptions zo = overlap_options(g);
    ZeroRedundancyOptimizer zero(net->parameters(), adam(), zo);
    ddp.register_comm_hook(hook_with_zero_step(std::make_unique<AllReduceHook>(g), ddp, zero));
    torch::Tensor x = batch_x(0).narrow(0, 4 * g.rank(), 4),
                  y = batch_y().narrow(0, 4 * g.rank(), 4);
    ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
    net->fc3->bias.set_requires_grad(false);
    zero.zero_grad();
    EXPECT_THAT(error_of([&] {
                  ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
                }),
                HasSubstr("does not support changing parameter trainability at run time"));
  });
}

// Overlap with the fp16 / bf16 compression hook inside: every rank ends with the same
// parameters, close to unsharded Adam (the gradients travel in 16 bits).
TEST(ZeroOverlapHookTest, Fp16AndBf16CompressionInsideTheOverlapHook) {
  constexpr int kSteps = 4;
  const auto expected = reference(kSteps);
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    const double tolerance = dtype == at::kHalf ? 1e-3 : 1e-2;
    run_ranks_as_threads(2, [&](comm::Group& g) {
      Net net = make_net();
      DistributedDataParallel ddp(net.ptr(), ddp_options(g, 1e-6));
      const ZeroOptions zo = overlap_options(g);
      ZeroRedundancyOptimizer zero(net->parameters(), adam(), zo);
      ddp.register_comm_hook(
          hook_with_zero_step_interleaved(std::make_unique<CompressHook>(g, dtype), ddp, zero));
      train(net, ddp, zero, g, 0, kSteps);
      auto params = net->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(params[i].allclose(expected[kSteps - 1][i], tolerance, tolerance))
            << dtype << " param " << i;
        std::vector<std::vector<at::Tensor>> all(1);
        for (int r = 0; r < g.size(); ++r) all[0].push_back(at::empty_like(params[i]));
        std::vector<at::Tensor> mine = {params[i].detach().clone()};
        g->allgather(all, mine)->wait();
        EXPECT_TRUE(all[0][0].equal(all[0][1]))
            << dtype << " param " << i << " differs between the ranks";
      }
    });
  }
}

// A frozen parameter: DDP leaves it out, so ZeRO must be built over DDP's parameters (a ZeRO that
// also holds the frozen one is a clear error); it then never moves while the others train.
TEST(ZeroOverlapHookTest, FrozenParametersStayOutAndStill) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    Net net = make_net();
    net->fc1->bias.set_requires_grad(false);
    const at::Tensor frozen_before = net->fc1->bias.detach().clone();
    const at::Tensor trained_before = net->fc1->weight.detach().clone();
    DistributedDataParallel ddp(net.ptr(), ddp_options(g));
    const ZeroOptions zo = overlap_options(g);
    ZeroRedundancyOptimizer with_frozen(net->parameters(), adam(), zo);
    EXPECT_THAT(error_of([&] {
                  hook_with_zero_step(std::make_unique<AllReduceHook>(g), ddp, with_frozen);
                }),
                HasSubstr("is not reduced by DDP (frozen"));
    ZeroRedundancyOptimizer zero(ddp.parameters(), adam(), zo);
    ddp.register_comm_hook(hook_with_zero_step(std::make_unique<AllReduceHook>(g), ddp, zero));
    train(net, ddp, zero, g, 0, 3);
    EXPECT_TRUE(net->fc1->bias.equal(frozen_before));
    EXPECT_FALSE(net->fc1->weight.equal(trained_before));
  });
}

// Consolidate after 3 overlapped steps, load into a fresh DDP + overlapped ZeRO, train 3 more:
// the parameters are unsharded Adam's after 6 steps.
TEST(ZeroOverlapHookTest, ConsolidateAndLoadContinueExactly) {
  constexpr int kSteps = 6;
  const auto expected = reference(kSteps);
  run_ranks_as_threads(2, [&](comm::Group& g) {
    const ZeroOptions zo = overlap_options(g);
    const DDPOptions d = ddp_options(g, 1e-6);
    Net net = make_net();
    DistributedDataParallel ddp(net.ptr(), d);
    ZeroRedundancyOptimizer zero(net->parameters(), adam(), zo);
    ddp.register_comm_hook(hook_with_zero_step(std::make_unique<AllReduceHook>(g), ddp, zero));
    train(net, ddp, zero, g, 0, 3);
    zero.consolidate_state_dict(0);
    c10::IValue saved = g.rank() == 0 ? zero.state_dict() : c10::IValue();
    ASSERT_TRUE(comm::broadcast_object(g, saved, 0).ok());

    Net resumed = make_net();
    {
      torch::NoGradGuard no_grad;
      auto from = net->parameters(), to = resumed->parameters();
      for (size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
    }
    DistributedDataParallel ddp2(resumed.ptr(), d);
    ZeroRedundancyOptimizer zero2(resumed->parameters(), adam(), zo);
    ddp2.register_comm_hook(hook_with_zero_step(std::make_unique<AllReduceHook>(g), ddp2, zero2));
    zero2.load_state_dict(saved);
    train(resumed, ddp2, zero2, g, 3, kSteps);
    auto params = resumed->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(params[i].allclose(expected[kSteps - 1][i], 1e-5, 1e-6))
          << "rank " << g.rank() << " param " << i << " max diff "
          << (params[i] - expected[kSteps - 1][i]).abs().max().item<float>();
    }
  });
}

}  // namespace
}  // namespace dtrain::ddp_hooks
