#include "ddp_hooks/zero_hook.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/test_harness.h"
#include "ddp_hooks/default_hooks.h"

namespace dtrain::ddp {
namespace {

using ::testing::HasSubstr;
using comm::testing::run_ranks_as_threads;
using optim::FunctionalOptimizerAdapter;
using optim::local_optimizer;
using optim::ZeroOptions;
using optim::ZeroRedundancyOptimizer;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 6));
    fc3 = register_module("fc3", torch::nn::Linear(6, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc3(torch::tanh(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

Net make_net() {
  Net net;
  torch::NoGradGuard no_grad;
  int k = 0;
  for (auto& p : net->parameters()) p.copy_(torch::sin(torch::arange(p.numel()).view(p.sizes()) * 0.3 + k++) * 0.5);
  return net;
}

torch::Tensor batch_x(int step) { return torch::cos(torch::arange(32, torch::kFloat).view({8, 4}) * 0.7 + step); }
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
};

void check_matches_unsharded_adam(const Case& c) {
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
    ZeroRedundancyOptimizer zero(net->parameters(), adam(), zo);
    auto hook = std::make_unique<ZeroOverlapHook>(std::make_unique<AllReduceHook>(g), ddp, zero, c.shard_buckets);
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
      torch::Tensor x = batch_x(s).narrow(0, 4 * g.rank(), 4), y = batch_y().narrow(0, 4 * g.rank(), 4);
      ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
      // The parameters were updated during backward; step() must not update them again.
      zero.step();
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

TEST(ZeroOverlapHookTest, OneParameterPerBucketMatchesUnshardedAdam) {
  check_matches_unsharded_adam({1e-6, false, false, false});
}

TEST(ZeroOverlapHookTest, BucketViewsOnBothSidesMatchUnshardedAdam) {
  check_matches_unsharded_adam({1e-6, false, true, true});
}

TEST(ZeroOverlapHookTest, ShardedBucketSlicesMatchUnshardedAdam) {
  // 209-byte buckets: {fc3, fc2} (75 elements, above the 57.5 threshold: cut into two slices
  // owned by different ranks) and {fc1} (40 elements).
  check_matches_unsharded_adam({0.0002, true, true, false});
}

TEST(ZeroOverlapHookTest, ShardedSmallBucketsMatchUnshardedAdam) {
  check_matches_unsharded_adam({0.0001, true, false, true});
}

TEST(ZeroOverlapHookTest, MisuseIsAClearError) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    Net net = make_net();
    DDPOptions d;
    d.group = g;
    DistributedDataParallel ddp(net.ptr(), d);
    auto message = [](const std::function<void()>& f) -> std::string {
      try {
        f();
      } catch (const c10::Error& e) {
        return e.what_without_backtrace();
      }
      return "no error";
    };
    ZeroOptions plain;
    plain.group = g;
    ZeroRedundancyOptimizer not_overlapped(net->parameters(), adam(), plain);
    EXPECT_THAT(message([&] { ZeroOverlapHook(std::make_unique<AllReduceHook>(g), ddp, not_overlapped, false); }),
                HasSubstr("overlap_with_ddp = true"));
    ZeroOptions zo = plain;
    zo.overlap_with_ddp = true;
    EXPECT_THAT(message([&] {
                  ZeroRedundancyOptimizer z(net->parameters(),
                                            local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.1)), zo);
                }),
                HasSubstr("needs a functional local optimizer"));
    // One 115-element bucket cannot be cut into 2 slices below 57.5 elements (PyTorch asserts).
    ZeroRedundancyOptimizer sharded(net->parameters(), adam(), zo);
    EXPECT_THAT(message([&] { ZeroOverlapHook(std::make_unique<AllReduceHook>(g), ddp, sharded, true); }),
                HasSubstr("needs more than 2 slices below the threshold"));
    auto params = net->parameters();
    params.pop_back();
    ZeroRedundancyOptimizer partial(params, adam(), zo);
    EXPECT_THAT(message([&] { ZeroOverlapHook(std::make_unique<AllReduceHook>(g), ddp, partial, false); }),
                HasSubstr("DDP parameter 'fc3.bias' is not a parameter of the ZeroRedundancyOptimizer"));
  });
}

}  // namespace
}  // namespace dtrain::ddp
