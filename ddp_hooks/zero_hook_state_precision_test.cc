// ZeRO overlapped with DDP (zero_hook.h) with its optimizer state in bfloat16 or 8 bits
// (optim/functional/state_precision.h): the steps the hook takes during backward are the steps
// ZeRO takes after it, bit for bit, where rounding does not depend on which rank holds what; each
// rank's state shrinks; consolidation and resume continue a run exactly. Ranks as threads.
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/object_collectives.h"
#include "comm/testing/test_harness.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/testing/fill_sin.h"
#include "ddp_hooks/testing/three_layer_mlp.h"
#include "ddp_hooks/zero_hook.h"
#include "optim/functional/state_precision.h"

namespace dtrain::ddp_hooks {
namespace {

using comm::testing::run_ranks_as_threads;
using optim::FunctionalOptimizerAdapter;
using optim::local_optimizer;
using optim::ZeroOptions;
using optim::ZeroRedundancyOptimizer;

// Parameters of 300 and 600 elements: 8-bit state in whole and partial blocks of 256.
struct NetImpl : ThreeLayerMlpImpl {
  NetImpl() : ThreeLayerMlpImpl(/*in=*/10, /*h1=*/30, /*h2=*/20, /*out=*/3) {}
};
TORCH_MODULE(Net);

Net make_net() {
  Net net;
  fill_sin(*net, 0.3);
  return net;
}

struct Precision {
  const char* name;
  const char* state_dtype;  // nullptr: the parameter's dtype
  bool stochastic;
};
const Precision kFloat32{"float32", nullptr, false};
const Precision kBf16Nearest{"bfloat16 to nearest", optim::kStateBFloat16, false};
const Precision kBf16Stochastic{"bfloat16 stochastic", optim::kStateBFloat16, true};
const Precision k8Bit{"8bit", optim::kState8Bit, false};

optim::LocalOptimizer adamw(const Precision& p) {
  optim::OptionsDict o = optim::new_options_dict();
  o.insert("lr", 0.01);
  o.insert("weight_decay", 0.01);
  if (p.state_dtype != nullptr) o.insert(optim::kStateDtypeKey, std::string(p.state_dtype));
  o.insert(optim::kStateStochasticRoundingKey, p.stochastic);
  return local_optimizer<FunctionalOptimizerAdapter>("AdamW", o);
}

ZeroOptions zero_options(comm::Group& g, bool overlap) {
  ZeroOptions zo;
  zo.group = g;
  zo.overlap_with_ddp = overlap;
  return zo;
}
DDPOptions ddp_options(comm::Group& g) {
  DDPOptions d;
  d.group = g;
  d.bucket_cap_mb = 1e-3;  // a few buckets, so that the hook steps more than once per backward
  d.first_bucket_cap_mb = 1e-3;
  return d;
}

// One training step of this rank's half of the batch; with `step_after` ZeRO steps after backward
// (no overlap), else the hook stepped it during backward.
void train_step(Net& net, DistributedDataParallel& ddp, ZeroRedundancyOptimizer& zero,
                comm::Group& g, int s, bool step_after) {
  zero.zero_grad();
  const torch::Tensor x = torch::cos(torch::arange(80, torch::kFloat).view({8, 10}) * 0.7 + s);
  const torch::Tensor y = torch::sin(torch::arange(24, torch::kFloat).view({8, 3}) + s);
  ddp.forward([&] {
       return torch::mse_loss(net->forward(x.narrow(0, 4 * g.rank(), 4)),
                              y.narrow(0, 4 * g.rank(), 4));
     })
      .backward();
  if (step_after) zero.step();
}

std::vector<torch::Tensor> snapshot(Net& net) {
  std::vector<torch::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

// Each precision, each schedule: overlapped ZeRO ends where ZeRO stepped after backward ends.
TEST(ZeroOverlapStatePrecisionTest, OverlappedStepsEqualStepsAfterBackward) {
  constexpr int kSteps = 4;
  for (const Precision& p : {kFloat32, kBf16Nearest, k8Bit}) {
    for (const auto& [schedule, shard_buckets] :
         {std::pair{ZeroStepSchedule::kAfterBackward, false},
          std::pair{ZeroStepSchedule::kInterleaved, false},
          std::pair{ZeroStepSchedule::kAfterBackward, true}}) {
      SCOPED_TRACE(
          std::string(p.name) +
          (schedule == ZeroStepSchedule::kInterleaved ? " interleaved" : " after backward") +
          (shard_buckets ? ", bucket slices" : ""));
      run_ranks_as_threads(2, [&](comm::Group& g) {
        Net plain_net = make_net();
        DistributedDataParallel plain_ddp(plain_net.ptr(), ddp_options(g));
        ZeroRedundancyOptimizer plain(plain_net->parameters(), adamw(p), zero_options(g, false));
        Net net = make_net();
        DistributedDataParallel ddp(net.ptr(), ddp_options(g));
        ZeroRedundancyOptimizer zero(net->parameters(), adamw(p), zero_options(g, true));
        ddp.register_comm_hook(std::make_unique<ZeroOverlapHook>(
            std::make_unique<AllReduceHook>(g), ddp, zero, shard_buckets, schedule));
        for (int s = 0; s < kSteps; ++s) {
          train_step(plain_net, plain_ddp, plain, g, s, /*step_after=*/true);
          train_step(net, ddp, zero, g, s, /*step_after=*/false);
          const auto want = snapshot(plain_net), got = snapshot(net);
          for (size_t i = 0; i < got.size(); ++i) {
            ASSERT_TRUE(got[i].equal(want[i]))
                << "rank " << g.rank() << " step " << s << " param " << i << " max diff "
                << (got[i] - want[i]).abs().max().item<float>();
          }
        }
      });
    }
  }
}

// The overlapped ZeRO's shard of state is the precision's fraction of float32's.
TEST(ZeroOverlapStatePrecisionTest, EachRanksStateShrinks) {
  run_ranks_as_threads(2, [&](comm::Group& g) {
    std::vector<int64_t> bytes;
    for (const Precision& p : {kFloat32, kBf16Stochastic, k8Bit}) {
      Net net = make_net();
      DistributedDataParallel ddp(net.ptr(), ddp_options(g));
      ZeroRedundancyOptimizer zero(net->parameters(), adamw(p), zero_options(g, true));
      ddp.register_comm_hook(hook_with_zero_step(std::make_unique<AllReduceHook>(g), ddp, zero));
      train_step(net, ddp, zero, g, 0, false);
      bytes.push_back(zero.local_state_bytes());
    }
    ASSERT_GT(bytes[0], 0);
    EXPECT_NEAR(static_cast<double>(bytes[1]) / bytes[0], 0.5, 0.02) << bytes[1];
    EXPECT_NEAR(static_cast<double>(bytes[2]) / bytes[0], 0.25, 0.05) << bytes[2];
  });
}

// Stochastic rounding under overlap: the ranks agree, and the run stays near float32's.
TEST(ZeroOverlapStatePrecisionTest, StochasticRoundingKeepsTheRanksEqualAndNearFloat32) {
  constexpr int kSteps = 5;
  run_ranks_as_threads(2, [&](comm::Group& g) {
    std::vector<std::vector<torch::Tensor>> ends;
    for (const Precision& p : {kFloat32, kBf16Stochastic}) {
      Net net = make_net();
      DistributedDataParallel ddp(net.ptr(), ddp_options(g));
      ZeroRedundancyOptimizer zero(net->parameters(), adamw(p), zero_options(g, true));
      ddp.register_comm_hook(
          hook_with_zero_step_interleaved(std::make_unique<AllReduceHook>(g), ddp, zero));
      for (int s = 0; s < kSteps; ++s) train_step(net, ddp, zero, g, s, false);
      ends.push_back(snapshot(net));
    }
    for (size_t i = 0; i < ends[1].size(); ++i) {
      c10::IValue mine = ends[1][i];
      ASSERT_TRUE(comm::broadcast_object(g, mine, 0).ok());
      EXPECT_TRUE(mine.toTensor().equal(ends[1][i])) << "param " << i << " differs between ranks";
      EXPECT_TRUE(ends[1][i].allclose(ends[0][i], 1e-3, 1e-3)) << "param " << i;
    }
  });
}

// Consolidate after 3 overlapped steps, load into a fresh DDP + overlapped ZeRO, 3 more: the same
// bits as 6 steps straight, state kept in its precision (the stochastic rounding's key is the step
// and the shard's parameter, both restored).
TEST(ZeroOverlapStatePrecisionTest, ConsolidateAndLoadContinueBitForBit) {
  for (const Precision& p : {kBf16Stochastic, k8Bit}) {
    SCOPED_TRACE(p.name);
    run_ranks_as_threads(2, [&](comm::Group& g) {
      auto start = [&](Net& net, DistributedDataParallel& ddp, ZeroRedundancyOptimizer& zero) {
        ddp.register_comm_hook(hook_with_zero_step(std::make_unique<AllReduceHook>(g), ddp, zero));
      };
      Net straight = make_net();
      DistributedDataParallel straight_ddp(straight.ptr(), ddp_options(g));
      ZeroRedundancyOptimizer straight_zero(straight->parameters(), adamw(p),
                                            zero_options(g, true));
      start(straight, straight_ddp, straight_zero);
      for (int s = 0; s < 6; ++s) train_step(straight, straight_ddp, straight_zero, g, s, false);

      Net first = make_net();
      DistributedDataParallel first_ddp(first.ptr(), ddp_options(g));
      ZeroRedundancyOptimizer first_zero(first->parameters(), adamw(p), zero_options(g, true));
      start(first, first_ddp, first_zero);
      for (int s = 0; s < 3; ++s) train_step(first, first_ddp, first_zero, g, s, false);
      first_zero.consolidate_state_dict(0);
      c10::IValue saved = g.rank() == 0 ? first_zero.state_dict() : c10::IValue();
      ASSERT_TRUE(comm::broadcast_object(g, saved, 0).ok());
      const auto state0 = saved.toGenericDict().at("state").toGenericDict().at(0).toGenericDict();
      if (std::string(p.state_dtype) == optim::kState8Bit) {
        EXPECT_EQ(state0.at("exp_avg_codes").toTensor().scalar_type(), at::kByte);
      } else {
        EXPECT_EQ(state0.at("exp_avg").toTensor().scalar_type(), at::kBFloat16);
      }

      Net resumed = make_net();
      {
        torch::NoGradGuard no_grad;
        auto from = first->parameters(), to = resumed->parameters();
        for (size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
      }
      DistributedDataParallel resumed_ddp(resumed.ptr(), ddp_options(g));
      ZeroRedundancyOptimizer resumed_zero(resumed->parameters(), adamw(p), zero_options(g, true));
      start(resumed, resumed_ddp, resumed_zero);
      resumed_zero.load_state_dict(saved);
      for (int s = 3; s < 6; ++s) train_step(resumed, resumed_ddp, resumed_zero, g, s, false);
      const auto want = snapshot(straight), got = snapshot(resumed);
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(got[i].equal(want[i])) << "rank " << g.rank() << " param " << i;
      }
    });
  }
}

}  // namespace
}  // namespace dtrain::ddp_hooks
