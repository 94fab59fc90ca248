// PostLocalSGDOptimizer around a functional optimizer whose state is kept in bfloat16 or 8 bits
// (optim/functional/state_precision.h): the wrapper's steps are the local optimizer's plus the
// averager's, its state dict carries the state in its precision, and a run resumed from it is the
// straight run, bit for bit. Ranks as threads.
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"
#include "optim/functional/adapter.h"
#include "optim/functional/state_precision.h"
#include "optim/model_averagers.h"
#include "optim/post_local_sgd_optimizer.h"

namespace dtrain::optim {
namespace {

using comm::testing::run_ranks_as_threads;

struct Precision {
  const char* name;
  const char* state_dtype;
  bool stochastic;
};
const Precision kPrecisions[] = {{"bfloat16 stochastic", kStateBFloat16, true},
                                 {"bfloat16 to nearest", kStateBFloat16, false},
                                 {"8bit", kState8Bit, false}};

// 300 and 600 elements: 8-bit blocks whole and partial.
std::vector<at::Tensor> params() {
  return {(at::cos(at::arange(300, at::kFloat)) * 0.5).requires_grad_(),
          (at::sin(at::arange(600, at::kFloat)) * 0.5).view({20, 30}).requires_grad_()};
}

// Gradients that differ by rank (no DDP here), so that averaging shows.
void local_grads(std::vector<at::Tensor>& p, int rank, int step) {
  for (size_t i = 0; i < p.size(); ++i) {
    p[i].mutable_grad() = at::sin(at::arange(p[i].numel(), at::kFloat).view(p[i].sizes()) * 0.01 +
                                  step * 0.3 + rank * 1.7 + static_cast<double>(i));
  }
}

std::unique_ptr<torch::optim::Optimizer> adamw(std::vector<at::Tensor> p, const Precision& pr) {
  OptionsDict o = new_options_dict();
  o.insert("lr", 0.01);
  o.insert("weight_decay", 0.01);
  o.insert(kStateDtypeKey, std::string(pr.state_dtype));
  o.insert(kStateStochasticRoundingKey, pr.stochastic);
  return std::make_unique<FunctionalOptimizerAdapter>(std::move(p), "AdamW", o);
}

std::shared_ptr<PeriodicModelAverager> averager(comm::Group& g) {
  return std::make_shared<PeriodicModelAverager>(/*period=*/2, /*warmup_steps=*/3, g);
}

std::vector<at::Tensor> clone(const std::vector<at::Tensor>& p) {
  std::vector<at::Tensor> out;
  for (const auto& t : p) out.push_back(t.detach().clone().requires_grad_());
  return out;
}

// The wrapper = the local low-precision optimizer's step, then the averager's.
TEST(PostLocalSGDStatePrecisionTest, StepsAreTheLocalOptimizersThenTheAveragers) {
  for (const Precision& pr : kPrecisions) {
    SCOPED_TRACE(pr.name);
    run_ranks_as_threads(2, [&](comm::Group& g) {
      std::vector<at::Tensor> p = params(), q = params();
      PostLocalSGDOptimizer opt(adamw(p, pr), averager(g));
      auto local = adamw(q, pr);
      auto by_hand = averager(g);
      for (int step = 0; step < 8; ++step) {
        local_grads(p, g.rank(), step);
        local_grads(q, g.rank(), step);
        opt.step();
        local->step();
        by_hand->average_parameters(q);
        for (size_t i = 0; i < p.size(); ++i) {
          ASSERT_TRUE(p[i].equal(q[i]))
              << "rank " << g.rank() << " step " << step << " param " << i;
        }
      }
    });
  }
}

// state_dict after 5 steps (mid-period, past warm-up), loaded into a fresh wrapper: 5 more steps
// give the straight run's 10, bit for bit; the state stays in its precision.
TEST(PostLocalSGDStatePrecisionTest, StateDictResumesBitForBit) {
  for (const Precision& pr : kPrecisions) {
    SCOPED_TRACE(pr.name);
    run_ranks_as_threads(2, [&](comm::Group& g) {
      std::vector<at::Tensor> straight = params();
      PostLocalSGDOptimizer straight_opt(adamw(straight, pr), averager(g));
      std::vector<at::Tensor> first = params();
      PostLocalSGDOptimizer first_opt(adamw(first, pr), averager(g));
      for (int step = 0; step < 10; ++step) {
        local_grads(straight, g.rank(), step);
        straight_opt.step();
        if (step < 5) {
          local_grads(first, g.rank(), step);
          first_opt.step();
        }
      }
      const c10::IValue sd = first_opt.state_dict();
      const auto state0 = sd.toGenericDict().at("state").toGenericDict().at(0).toGenericDict();
      if (std::string(pr.state_dtype) == kState8Bit) {
        EXPECT_EQ(state0.at("exp_avg_codes").toTensor().scalar_type(), at::kByte);
        EXPECT_EQ(state0.at("exp_avg_sq_absmax").toTensor().numel(), quant_blocks(300));
      } else {
        EXPECT_EQ(state0.at("exp_avg_sq").toTensor().scalar_type(), at::kBFloat16);
      }
      std::vector<at::Tensor> resumed = clone(first);
      PostLocalSGDOptimizer resumed_opt(adamw(resumed, pr), averager(g));
      resumed_opt.load_state_dict(sd);
      EXPECT_EQ(resumed_opt.averager().step(), 5);
      for (int step = 5; step < 10; ++step) {
        local_grads(resumed, g.rank(), step);
        resumed_opt.step();
      }
      for (size_t i = 0; i < resumed.size(); ++i) {
        EXPECT_TRUE(resumed[i].equal(straight[i])) << "rank " << g.rank() << " param " << i;
      }
    });
  }
}

}  // namespace
}  // namespace dtrain::optim
