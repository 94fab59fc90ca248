// ZeRO over bfloat16 parameters whose local AdamW keeps param_remainders (an int16 remainder per
// element: with the bfloat16 parameter, an exact float32 master; optim/functional/adam.h): every
// partition (sorted-greedy with and without bucket views, kFlat) steps bit for bit as one
// unsharded FunctionalAdamW with param_remainders, each remainder lives only on the rank owning
// its elements, consolidate_state_dict carries them, and consolidated and sharded checkpoints
// resume bit for bit at another world size. Ranks as threads, world sizes 1 to 3.
#include <filesystem>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"
#include "optim/functional/adapter.h"
#include "optim/functional/state_precision.h"
#include "optim/zero/testing/zero_test_util.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::optim {
namespace {

using comm::testing::run_ranks_as_threads;
using namespace optim::testing;  // NOLINT: the shared test helpers

// Uneven sizes: kFlat's ranges cut parameters, 8-bit state has whole and partial blocks.
const std::vector<int64_t> kRemSizes = {300, 7, 600, 257, 1, 40};

struct Case {
  PartitionStrategy strategy;
  bool bucket_view;
  const char* state_dtype;  // nullptr: float32 state
};
std::string name(const Case& c) {
  return std::string(c.strategy == PartitionStrategy::kFlat ? "flat" : "sorted_greedy") +
         (c.bucket_view ? " bucket_view " : " ") + (c.state_dtype ? c.state_dtype : "float32");
}
const std::vector<Case> kCases = {
    {PartitionStrategy::kSortedGreedy, false, nullptr},
    {PartitionStrategy::kSortedGreedy, true, kStateBFloat16},
    {PartitionStrategy::kSortedGreedy, false, kState8Bit},
    {PartitionStrategy::kFlat, false, nullptr},
    {PartitionStrategy::kFlat, false, kStateBFloat16},
};

OptionsDict adamw(const char* state_dtype) {
  OptionsDict o = new_options_dict();
  o.insert("lr", 0.01);
  o.insert("weight_decay", 0.1);
  o.insert(kParamRemaindersKey, true);
  if (state_dtype != nullptr) o.insert(kStateDtypeKey, std::string(state_dtype));
  // Rounded to nearest: stochastic rounding is keyed by the index in the local optimizer.
  o.insert(kStateStochasticRoundingKey, false);
  return o;
}

ZeroOptions options_for(comm::Group& g, const Case& c) {
  ZeroOptions o = zero_options(g, c.bucket_view);
  o.strategy = c.strategy;
  o.flat_alignment = 4;
  return o;
}

std::vector<at::Tensor> bf16_params() {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : make_params(kRemSizes))
    out.push_back(p.detach().to(at::kBFloat16).requires_grad_());
  return out;
}

// DDP-averaged gradients are equal on every rank: the same bfloat16 gradients everywhere.
void set_grads(std::vector<at::Tensor>& params, int step) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i].mutable_grad() = grad_for(params[i], 0, step, i).to(at::kBFloat16);
}

// `opt` over `params` (the unsharded reference or a rank's ZeRO), stepped from `from` to `to`.
void take_steps(torch::optim::Optimizer& opt, std::vector<at::Tensor>& params, int from, int to) {
  for (int step = from; step < to; ++step) {
    set_grads(params, step);
    opt.step();
  }
}

// (SCOPED_TRACE does not reach the rank threads: `what` names the case.)
void expect_bits_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                       const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].scalar_type(), at::kBFloat16) << i;
    EXPECT_TRUE(at::equal(a[i].view(at::kShort), b[i].view(at::kShort))) << what << ": param " << i;
  }
}

// The state of parameter `i` in a global (PyTorch-format) optimizer state dict.
c10::impl::GenericDict entry_of(const c10::IValue& sd, int64_t i) {
  return sd.toGenericDict().at("state").toGenericDict().at(i).toGenericDict();
}

TEST(ZeroParamRemaindersTest, StepsEqualUnshardedBitForBitAndRemaindersStayWithTheirOwner) {
  for (int world : {1, 2, 3}) {
    for (const Case& c : kCases) {
      const std::string what = "world " + std::to_string(world) + " " + name(c);
      run_ranks_as_threads(world, [&](comm::Group& g) {
        std::vector<at::Tensor> zp = bf16_params();
        std::vector<at::Tensor> rp = clone_params(zp);
        ZeroRedundancyOptimizer zero(
            zp, local_optimizer<FunctionalOptimizerAdapter>("AdamW", adamw(c.state_dtype)),
            options_for(g, c));
        FunctionalOptimizerAdapter reference(rp, "AdamW", adamw(c.state_dtype));
        for (int step = 0; step < 4; ++step) {
          take_steps(zero, zp, step, step + 1);
          take_steps(reference, rp, step, step + 1);
          expect_bits_equal(zp, rp, what + " step " + std::to_string(step));
        }
        // This rank's shard holds a remainder for exactly the elements it owns.
        const checkpoint::ShardedState mine = zero.sharded_state();
        const auto owned = zero.owned_ranges();
        ASSERT_EQ(mine.params.size(), owned.size());
        for (const auto& [param, piece] : mine.params) {
          ASSERT_EQ(owned.count(param), 1u) << param;
          const at::Tensor rem = piece.entries.at(kParamRemainderKey).toTensor();
          EXPECT_EQ(rem.scalar_type(), at::kShort);
          EXPECT_EQ(rem.numel(), owned.at(param).size()) << what << ": param " << param;
        }
      });
    }
  }
}

// The consolidated state carries every remainder (int16, the unsharded optimizer's bits) and a
// ZeRO at another world size and partition resumes from it bit for bit as the straight run.
TEST(ZeroParamRemaindersTest, ConsolidatedStateCarriesRemaindersAndResumesBitExact) {
  const Case flat{PartitionStrategy::kFlat, false, kStateBFloat16};
  const Case greedy{PartitionStrategy::kSortedGreedy, true, kStateBFloat16};
  for (const auto& [from, to] : {std::pair{flat, greedy}, std::pair{greedy, flat}}) {
    const std::string what = name(from) + " -> " + name(to);
    SCOPED_TRACE(what);
    c10::IValue consolidated;
    std::vector<at::Tensor> after;
    run_ranks_as_threads(2, [&](comm::Group& g) {
      std::vector<at::Tensor> zp = bf16_params();
      ZeroRedundancyOptimizer zero(
          zp, local_optimizer<FunctionalOptimizerAdapter>("AdamW", adamw(kStateBFloat16)),
          options_for(g, from));
      take_steps(zero, zp, 0, 3);
      zero.consolidate_state_dict(0);
      if (g.rank() == 0) {
        consolidated = zero.state_dict();
        after = clone_params(zp);
      }
    });
    std::vector<at::Tensor> rp = bf16_params();
    FunctionalOptimizerAdapter straight(rp, "AdamW", adamw(kStateBFloat16));
    take_steps(straight, rp, 0, 3);
    const c10::IValue expected = straight.state_dict();
    for (int64_t i = 0; i < static_cast<int64_t>(kRemSizes.size()); ++i) {
      const at::Tensor rem = entry_of(consolidated, i).at(kParamRemainderKey).toTensor();
      EXPECT_EQ(rem.scalar_type(), at::kShort) << i;
      EXPECT_TRUE(at::equal(rem, entry_of(expected, i).at(kParamRemainderKey).toTensor())) << i;
    }
    const auto group = consolidated.toGenericDict().at("param_groups").toList().get(0);
    EXPECT_TRUE(group.toGenericDict().at(kParamRemaindersKey).toBool());
    take_steps(straight, rp, 3, 6);
    run_ranks_as_threads(3, [&](comm::Group& g) {
      std::vector<at::Tensor> zp = clone_params(after);
      // Built without param_remainders: the consolidated param group brings it back.
      OptionsDict plain = adamw(kStateBFloat16);
      plain.erase(kParamRemaindersKey);
      ZeroRedundancyOptimizer zero(zp, local_optimizer<FunctionalOptimizerAdapter>("AdamW", plain),
                                   options_for(g, to));
      zero.load_state_dict(consolidated);
      take_steps(zero, zp, 3, 6);
      expect_bits_equal(zp, rp, what);
    });
  }
}

std::string fresh_dir(const std::string& leaf) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / leaf;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

// save_sharded writes each rank's remainders with its shard; load_sharded at another world size
// and partition reads back the pieces it owns and continues bit for bit.
TEST(ZeroParamRemaindersTest, ShardedSaveResumesBitExactAtAnotherWorldSize) {
  const Case flat{PartitionStrategy::kFlat, false, nullptr};
  const Case greedy{PartitionStrategy::kSortedGreedy, false, nullptr};
  for (const auto& [from, to] : {std::pair{flat, greedy}, std::pair{greedy, flat}}) {
    const std::string what = name(from) + " -> " + name(to);
    const std::string dir = fresh_dir("zero_param_remainders");
    std::vector<at::Tensor> after;
    run_ranks_as_threads(3, [&](comm::Group& g) {
      std::vector<at::Tensor> zp = bf16_params();
      ZeroRedundancyOptimizer zero(
          zp, local_optimizer<FunctionalOptimizerAdapter>("AdamW", adamw(nullptr)),
          options_for(g, from));
      take_steps(zero, zp, 0, 3);
      ASSERT_TRUE(zero.save_sharded(dir).ok());
      if (g.rank() == 0) after = clone_params(zp);
    });
    std::vector<at::Tensor> rp = bf16_params();
    FunctionalOptimizerAdapter straight(rp, "AdamW", adamw(nullptr));
    take_steps(straight, rp, 0, 6);
    run_ranks_as_threads(2, [&](comm::Group& g) {
      std::vector<at::Tensor> zp = clone_params(after);
      ZeroRedundancyOptimizer zero(
          zp, local_optimizer<FunctionalOptimizerAdapter>("AdamW", adamw(nullptr)),
          options_for(g, to));
      absl::StatusOr<c10::IValue> extra = zero.load_sharded(dir);
      ASSERT_TRUE(extra.ok()) << extra.status();
      take_steps(zero, zp, 3, 6);
      expect_bits_equal(zp, rp, what);
    });
  }
}

}  // namespace
}  // namespace dtrain::optim
