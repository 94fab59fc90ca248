// ZeRO with its shard's optimizer state in bfloat16 or 8 bits (optim/functional/state_precision.h):
// each rank's state smaller by the precision's factor, the same steps as the unsharded optimizer
// where rounding does not depend on the shard, consolidation and resume, and 8-bit refused where a
// partition cuts its blocks. Ranks as threads, world sizes 2 and 3.
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
using ::testing::HasSubstr;
using namespace optim::testing;  // NOLINT: the shared test helpers

// Sizes with whole blocks and partial ones.
const std::vector<int64_t> kBigSizes = {300, 1000, 7, 600, 257};

OptionsDict adamw(const char* state_dtype, bool stochastic) {
  OptionsDict o = new_options_dict();
  o.insert("lr", 0.01);
  if (state_dtype != nullptr) o.insert(kStateDtypeKey, std::string(state_dtype));
  o.insert(kStateStochasticRoundingKey, stochastic);
  return o;
}

ZeroOptions options_for(comm::Group& g, PartitionStrategy strategy) {
  ZeroOptions o = zero_options(g, false);
  o.strategy = strategy;
  o.flat_alignment = 4;
  return o;
}

// Rounding to nearest and 8-bit blocks of whole parameters do not depend on which rank holds what:
// ZeRO's steps equal the unsharded optimizer's bit for bit.
TEST(ZeroStatePrecisionTest, ShardedStepsEqualUnshardedWhereRoundingIsShardFree) {
  struct Case {
    const char* dtype;
    PartitionStrategy strategy;
  };
  for (int world : {2, 3}) {
    for (const Case& c : {Case{kStateBFloat16, PartitionStrategy::kSortedGreedy},
                          Case{kStateBFloat16, PartitionStrategy::kFlat},
                          Case{kState8Bit, PartitionStrategy::kSortedGreedy}}) {
      SCOPED_TRACE(std::to_string(world) + " " + c.dtype);
      run_ranks_as_threads(world, [&](comm::Group& g) {
        std::vector<at::Tensor> zp = make_params(kBigSizes);
        std::vector<at::Tensor> rp = clone_params(zp);
        ZeroRedundancyOptimizer zero(
            zp, local_optimizer<FunctionalOptimizerAdapter>("AdamW", adamw(c.dtype, false)),
            options_for(g, c.strategy));
        FunctionalOptimizerAdapter reference(rp, "AdamW", adamw(c.dtype, false));
        for (int step = 0; step < 6; ++step) {
          set_averaged_grads(g, zp, step);
          set_averaged_grads(g, rp, step);
          zero.step();
          reference.step();
          for (size_t i = 0; i < zp.size(); ++i) {
            ASSERT_TRUE(at::equal(zp[i], rp[i])) << "step " << step << " param " << i;
          }
        }
      });
    }
  }
}

// Each rank's shard of state shrinks by the precision's factor: about 1/2 in bfloat16 and 1/4 (plus
// a scale per 256) in 8 bits.
TEST(ZeroStatePrecisionTest, StatePerRankShrinks) {
  run_ranks_as_threads(2, [&](comm::Group& g) {
    std::vector<int64_t> bytes;
    for (const char* dtype : {static_cast<const char*>(nullptr), kStateBFloat16, kState8Bit}) {
      std::vector<at::Tensor> params = make_params(kBigSizes);
      ZeroRedundancyOptimizer zero(
          params, local_optimizer<FunctionalOptimizerAdapter>("AdamW", adamw(dtype, true)),
          options_for(g, PartitionStrategy::kSortedGreedy));
      set_averaged_grads(g, params, 0);
      zero.step();
      bytes.push_back(zero.local_state_bytes());
    }
    EXPECT_GT(bytes[0], 0);
    EXPECT_NEAR(static_cast<double>(bytes[1]) / bytes[0], 0.5, 0.02) << bytes[1];
    EXPECT_NEAR(static_cast<double>(bytes[2]) / bytes[0], 0.25, 0.03) << bytes[2];
  });
}

// consolidate_state_dict gathers the low-precision state whole; a fresh ZeRO at another world size
// loads it and goes on exactly as a straight run at that size from the same state.
TEST(ZeroStatePrecisionTest, ConsolidatedStateResumesAtAnotherWorldSize) {
  for (const char* dtype : {kStateBFloat16, kState8Bit}) {
    SCOPED_TRACE(dtype);
    c10::IValue consolidated;
    std::vector<at::Tensor> after;
    run_ranks_as_threads(2, [&](comm::Group& g) {
      std::vector<at::Tensor> params = make_params(kBigSizes);
      ZeroRedundancyOptimizer zero(
          params, local_optimizer<FunctionalOptimizerAdapter>("AdamW", adamw(dtype, false)),
          options_for(g, PartitionStrategy::kSortedGreedy));
      for (int step = 0; step < 3; ++step) {
        set_averaged_grads(g, params, step);
        zero.step();
      }
      zero.consolidate_state_dict(0);
      if (g.rank() == 0) {
        consolidated = zero.state_dict();
        after = clone_params(params);
      }
    });
    const auto state = consolidated.toGenericDict().at("state").toGenericDict();
    ASSERT_EQ(state.size(), kBigSizes.size());
    const auto first = state.at(0).toGenericDict();
    if (std::string(dtype) == kState8Bit) {
      EXPECT_EQ(first.at("exp_avg_codes").toTensor().scalar_type(), at::kByte);
    } else {
      EXPECT_EQ(first.at("exp_avg").toTensor().scalar_type(), at::kBFloat16);
    }
    // World 3 resumes from it; an unsharded optimizer resumes from it too: the same steps.
    run_ranks_as_threads(3, [&](comm::Group& g) {
      std::vector<at::Tensor> zp = clone_params(after);
      std::vector<at::Tensor> rp = clone_params(after);
      ZeroRedundancyOptimizer zero(
          zp, local_optimizer<FunctionalOptimizerAdapter>("AdamW", adamw(nullptr, false)),
          options_for(g, PartitionStrategy::kSortedGreedy));
      zero.load_state_dict(consolidated);
      FunctionalOptimizerAdapter reference(rp, "AdamW", adamw(nullptr, false));
      reference.load_state_dict(consolidated);
      for (int step = 3; step < 6; ++step) {
        set_averaged_grads(g, zp, step);
        set_averaged_grads(g, rp, step);
        zero.step();
        reference.step();
      }
      for (size_t i = 0; i < zp.size(); ++i) EXPECT_TRUE(at::equal(zp[i], rp[i])) << i;
    });
  }
}

TEST(ZeroStatePrecisionTest, EightBitRefusedWhereThePartitionCutsBlocks) {
  run_ranks_as_threads(2, [&](comm::Group& g) {
    std::vector<at::Tensor> params = make_params(kBigSizes);
    try {
      ZeroRedundancyOptimizer zero(
          params, local_optimizer<FunctionalOptimizerAdapter>("AdamW", adamw(kState8Bit, true)),
          options_for(g, PartitionStrategy::kFlat));
      ADD_FAILURE() << "8-bit state accepted under the flat partition";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("state_dtype='8bit' keeps blocks of 256 elements"));
      EXPECT_THAT(e.what(), HasSubstr("kSortedGreedy"));
    }
  });
}

}  // namespace
}  // namespace dtrain::optim
