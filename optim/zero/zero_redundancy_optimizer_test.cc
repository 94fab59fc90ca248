#include "optim/zero/zero_redundancy_optimizer.h"

#include <atomic>
#include <filesystem>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "comm/coalesced.h"
#include "comm/testing/test_harness.h"
#include "optim/functional/torch_state.h"
#include "optim/zero/testing/zero_test_util.h"

namespace dtrain::optim {
namespace {

using comm::testing::run_ranks_as_threads;
using ::testing::HasSubstr;
using namespace optim::testing;  // NOLINT: the shared test helpers

// ZeRO and the unsharded optimizer, fed the same averaged gradients, stay equal; half way a
// parameter is frozen (trainability change, buckets rebuilt).
template <typename Make>
void parity(int world, bool bucket_view, Make make, int64_t overlap_chunk_bytes = int64_t{8} << 20,
            PartitionStrategy strategy = PartitionStrategy::kSortedGreedy) {
  run_ranks_as_threads(world, [&](comm::Group& g) {
    std::vector<at::Tensor> zp = make_params(kSizes);
    std::vector<at::Tensor> rp = clone_params(zp);
    auto [zero_local, reference] = make(rp);
    ZeroOptions options = zero_options(g, bucket_view);
    options.overlap_chunk_bytes = overlap_chunk_bytes;
    options.strategy = strategy;
    options.flat_alignment = 4;
    ZeroRedundancyOptimizer zero(zp, std::move(zero_local), options);
    for (int step = 0; step < 10; ++step) {
      if (step == 5) {
        zp[2].requires_grad_(false);
        rp[2].requires_grad_(false);
      }
      set_averaged_grads(g, zp, step);
      set_averaged_grads(g, rp, step);
      zero.step();
      reference->step();
      for (size_t i = 0; i < zp.size(); ++i) {
        ASSERT_TRUE(zp[i].allclose(rp[i], 1e-6, 1e-7)) << "step " << step << " param " << i;
      }
    }
    if (strategy == PartitionStrategy::kSortedGreedy) {
      // Sharded state: this rank holds only its parameters' state.
      EXPECT_EQ(zero.local_optimizer().param_groups()[0].params().size(),
                zero.partition().params_per_rank[g.rank()][0].size());
    }
  });
}

TEST(ZeroRedundancyOptimizerTest, MatchesUnshardedSGDAdamAdamW) {
  for (bool bucket_view : {false, true}) {
    SCOPED_TRACE(bucket_view ? "bucket view" : "per parameter");
    parity(2, bucket_view, [](std::vector<at::Tensor>& ref) {
      return std::make_pair(
          local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9)),
          std::make_unique<torch::optim::SGD>(ref, torch::optim::SGDOptions(0.1).momentum(0.9)));
    });
    parity(3, bucket_view, [](std::vector<at::Tensor>& ref) {
      return std::make_pair(
          local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
          std::make_unique<torch::optim::Adam>(ref, torch::optim::AdamOptions(0.01)));
    });
    parity(2, bucket_view, [](std::vector<at::Tensor>& ref) {
      return std::make_pair(
          local_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(0.01)),
          std::make_unique<torch::optim::AdamW>(ref, torch::optim::AdamWOptions(0.01)));
    });
  }
}

TEST(ZeroRedundancyOptimizerTest, FunctionalLocalOptimizerThroughTheAdapter) {
  // The overlapped step+sync path, in one chunk and in many (tiny chunks: a few parameters each).
  for (int64_t chunk_bytes : {int64_t{8} << 20, int64_t{32}}) {
    for (bool bucket_view : {false, true}) {
      SCOPED_TRACE(std::to_string(chunk_bytes) + (bucket_view ? " bucket view" : " per parameter"));
      parity(
          3, bucket_view,
          [](std::vector<at::Tensor>& ref) {
            OptionsDict o = new_options_dict();
            o.insert("lr", 0.01);
            return std::make_pair(
                local_optimizer<FunctionalOptimizerAdapter>("Adam", o),
                std::make_unique<torch::optim::Adam>(ref, torch::optim::AdamOptions(0.01)));
          },
          chunk_bytes);
    }
  }
}

TEST(ZeroRedundancyOptimizerTest, LocalOptimizerOptionsWrittenInPlace) {
  // Every option reaches the adapter (with the defaults, lr alone would already differ).
  parity(2, false, [](std::vector<at::Tensor>& ref) {
    return std::make_pair(
        local_optimizer<FunctionalOptimizerAdapter>(
            "Adam", {{"lr", 0.02}, {"amsgrad", true}, {"weight_decay", 0.1}}),
        std::make_unique<torch::optim::Adam>(
            ref, torch::optim::AdamOptions(0.02).amsgrad(true).weight_decay(0.1)));
  });
  // A repeated key is a mistake (Python rejects a repeated keyword argument), not "the last wins".
  expect_error(
      [] {
        local_optimizer<FunctionalOptimizerAdapter>("Adam", {{"lr", 0.02}, {"lr", 0.5}});
      },
      "local_optimizer(\"Adam\", ...): option 'lr' is given twice");
}

TEST(ZeroRedundancyOptimizerTest, FlatStrategyMatchesUnsharded) {
  for (int world : {2, 3}) {
    SCOPED_TRACE(world);
    parity(
        world, false,
        [](std::vector<at::Tensor>& ref) {
          return std::make_pair(
              local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9)),
              std::make_unique<torch::optim::SGD>(ref,
                                                  torch::optim::SGDOptions(0.1).momentum(0.9)));
        },
        int64_t{8} << 20, PartitionStrategy::kFlat);
    parity(
        world, false,
        [](std::vector<at::Tensor>& ref) {
          OptionsDict o = new_options_dict();
          o.insert("lr", 0.01);
          return std::make_pair(
              local_optimizer<FunctionalOptimizerAdapter>("Adam", o),
              std::make_unique<torch::optim::Adam>(ref, torch::optim::AdamOptions(0.01)));
        },
        int64_t{8} << 20, PartitionStrategy::kFlat);
  }
}

// Swept over world sizes 1-8 under both partitions: every rank's ZeRO(Adam) equals plain Adam
// (ranks that own no parameter at the larger sizes included).
class ZeroWorldTest : public ::testing::TestWithParam<std::tuple<int, PartitionStrategy>> {};

TEST_P(ZeroWorldTest, MatchesUnshardedAdam) {
  const auto [world, strategy] = GetParam();
  parity(
      world, /*bucket_view=*/true,
      [](std::vector<at::Tensor>& ref) {
        OptionsDict o = new_options_dict();
        o.insert("lr", 0.01);
        return std::make_pair(
            local_optimizer<FunctionalOptimizerAdapter>("Adam", o),
            std::make_unique<torch::optim::Adam>(ref, torch::optim::AdamOptions(0.01)));
      },
      int64_t{8} << 20, strategy);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ZeroWorldTest,
                         ::testing::Combine(::testing::Range(1, 9),
                                            ::testing::Values(PartitionStrategy::kSortedGreedy,
                                                              PartitionStrategy::kFlat)));

TEST(ZeroRedundancyOptimizerTest, FlatStrategyBalanceWithADominantParameter) {
  run_ranks_as_threads(3, [](comm::Group& g) {
    // One parameter holds ~95% of the elements: sorted-greedy cannot balance it, flat can.
    std::vector<int64_t> sizes = {200000, 3000, 3000, 2000, 1000, 500};
    ZeroOptions o = zero_options(g, false);
    o.strategy = PartitionStrategy::kFlat;
    ZeroRedundancyOptimizer flat(
        make_params(sizes), local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions()), o);
    ZeroRedundancyOptimizer greedy(make_params(sizes),
                                   local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions()),
                                   zero_options(g, false));
    int64_t total = 0;
    for (int64_t n : sizes) total += n;
    auto balance = [&](const ZeroRedundancyOptimizer& z) {
      const auto& n = z.partition().numel_per_rank;
      return static_cast<double>(*std::max_element(n.begin(), n.end())) * 3 / total;
    };
    EXPECT_LE(balance(flat), 1.01);
    EXPECT_GT(balance(greedy), 2.5);
  });
}

TEST(ZeroRedundancyOptimizerTest, StepWithClosureAndLrScheduler) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    std::vector<at::Tensor> p = make_params({4, 4});
    ZeroRedundancyOptimizer zero(p,
                                 local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(1.0)),
                                 zero_options(g, false));
    at::Tensor loss = zero.step([&] {
      zero.zero_grad();
      at::Tensor l = (p[0] * p[0]).sum() + p[1].sum();
      l.backward();
      return l;
    });
    EXPECT_TRUE(loss.defined());
    // A scheduler changes the wrapper's lr: the shard's optimizer follows.
    zero.param_groups()[0].options().set_lr(0.25);
    set_averaged_grads(g, p, 0);
    zero.step();
    EXPECT_DOUBLE_EQ(zero.local_optimizer().param_groups()[0].options().get_lr(), 0.25);
    EXPECT_DOUBLE_EQ(zero.param_groups()[0].options().get_lr(), 0.25);
  });
}

TEST(ZeroRedundancyOptimizerTest, ShardingBalanceAndAddParamGroup) {
  for (int world : {2, 3, 4}) {
    run_ranks_as_threads(world, [world](comm::Group& g) {
      std::vector<int64_t> sizes;
      for (int i = 0; i < world; ++i) sizes.insert(sizes.end(), {9, 7, 5, 3});
      std::vector<at::Tensor> p = make_params(sizes);
      ZeroRedundancyOptimizer zero(
          p, local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)),
          zero_options(g, true));
      for (int r = 0; r < world; ++r) EXPECT_EQ(zero.partition().numel_per_rank[r], 24);
      // A second group, with one large frozen parameter among them: still balanced.
      std::vector<at::Tensor> more = make_params(sizes);
      more.push_back(at::zeros({48 * world}));  // frozen (no requires_grad)
      zero.add_param_group(torch::optim::OptimizerParamGroup(more));
      const int64_t total = 48 * world + 48 * world;
      for (int r = 0; r < world; ++r)
        EXPECT_LE(zero.partition().numel_per_rank[r], total / world + 48 * world);
      EXPECT_EQ(zero.param_groups().size(), 2u);
      set_averaged_grads(g, p, 0);
      set_averaged_grads(g, more, 0);
      zero.step();
    });
  }
}

TEST(ZeroRedundancyOptimizerTest, GroupsAtConstructionEqualGroupsAddedLaterEqualPlainAdamW) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    std::vector<at::Tensor> a = make_params(kSizes), b = clone_params(a), c = clone_params(a);
    auto split = [](std::vector<at::Tensor>& v, size_t k, double lr) {
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(std::vector<at::Tensor>(v.begin(), v.begin() + k));
      groups.emplace_back(std::vector<at::Tensor>(v.begin() + k, v.end()),
                          std::make_unique<torch::optim::AdamWOptions>(lr));
      return groups;
    };
    ZeroRedundancyOptimizer zero_a(
        split(a, 3, 0.05), local_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(0.01)),
        zero_options(g, false));
    ZeroRedundancyOptimizer zero_b(
        std::vector<at::Tensor>(b.begin(), b.begin() + 3),
        local_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(0.01)),
        zero_options(g, true));
    zero_b.add_param_group(
        torch::optim::OptimizerParamGroup(std::vector<at::Tensor>(b.begin() + 3, b.end()),
                                          std::make_unique<torch::optim::AdamWOptions>(0.05)));
    torch::optim::AdamW plain(split(c, 3, 0.05), torch::optim::AdamWOptions(0.01));
    for (int step = 0; step < 5; ++step) {
      set_averaged_grads(g, a, step);
      set_averaged_grads(g, b, step);
      set_averaged_grads(g, c, step);
      zero_a.step();
      zero_b.step();
      plain.step();
    }
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(a[i].allclose(c[i], 1e-6, 1e-7)) << i;
      EXPECT_TRUE(b[i].allclose(c[i], 1e-6, 1e-7)) << i;
    }
  });
}

TEST(ZeroRedundancyOptimizerTest, NonDefaultSubgroup) {
  run_ranks_as_threads(4, [](comm::Group& world) {
    auto sub = comm::new_subgroups(world, 2);
    ASSERT_TRUE(sub.ok());
    std::vector<at::Tensor> zp = make_params(kSizes), rp = clone_params(zp);
    ZeroRedundancyOptimizer zero(zp,
                                 local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)),
                                 zero_options(sub->mine, true));
    torch::optim::SGD reference(rp, torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 3; ++step) {
      set_averaged_grads(sub->mine, zp, step);
      set_averaged_grads(sub->mine, rp, step);
      zero.step();
      reference.step();
    }
    for (size_t i = 0; i < zp.size(); ++i) EXPECT_TRUE(zp[i].allclose(rp[i])) << i;
  });
}

TEST(ZeroRedundancyOptimizerTest, ConstructorErrors) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    auto sgd = [] { return local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)); };
    expect_error(
        [&] { ZeroRedundancyOptimizer(std::vector<at::Tensor>{}, sgd(), zero_options(g, false)); },
        "ZeroRedundancyOptimizer got an empty parameter list");
    expect_error(
        [&] {
          ZeroRedundancyOptimizer(
              {at::zeros({2}).requires_grad_(), at::zeros({2}, at::kDouble).requires_grad_()},
              sgd(), zero_options(g, false));
        },
        "only supports using the same dense type for all parameters but got both Float cpu tensor "
        "and Double cpu tensor");
    expect_error(
        [&] {
          ZeroRedundancyOptimizer({at::zeros({2, 2}).to_sparse()}, sgd(), zero_options(g, false));
        },
        "only supports using the same dense type for all parameters but got sparse");
    ZeroOptions manual = zero_options(g, false);
    manual.params_per_rank = {{0}};
    expect_error(
        [&] {
          ZeroRedundancyOptimizer(make_params({2, 2}), sgd(), manual);
        },
        "`params_per_rank` must have length equal to the world size");
    manual.params_per_rank = {{0}, {5}};
    expect_error(
        [&] {
          ZeroRedundancyOptimizer(make_params({2, 2}), sgd(), manual);
        },
        "Passing a new parameter in `params_per_rank`");
    std::vector<torch::optim::OptimizerParamGroup> two;
    two.emplace_back(make_params({2}));
    two.emplace_back(make_params({2}));
    manual.params_per_rank = {{0}, {1}};
    expect_error([&] { ZeroRedundancyOptimizer(std::move(two), sgd(), manual); },
                 "Specifying `params_per_rank` only supports a single parameter group");
    // A valid manual partition is honoured.
    ZeroRedundancyOptimizer ok(make_params({2, 3}), sgd(), manual);
    EXPECT_EQ(ok.partition().owner, (std::vector<int>{0, 1}));
  });
}

TEST(ZeroRedundancyOptimizerTest, JoinWithUnevenInputs) {
  run_ranks_as_threads(3, [](comm::Group& g) {
    std::vector<at::Tensor> p = make_params(kSizes);
    ZeroRedundancyOptimizer zero(
        p, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
        zero_options(g, true));
    const int my_inputs = 3 + 2 * g.rank();  // 3, 5, 7
    comm::Join join({&zero});
    for (int step = 0; step < my_inputs; ++step) {
      for (size_t i = 0; i < p.size(); ++i) p[i].mutable_grad() = grad_for(p[i], 0, step, i);
      zero.step();
    }
    join.finish();  // ranks 0 and 1 keep stepping their shards until rank 2 is done
    // Every rank ends with the same parameters, and every shard took 7 steps.
    std::vector<at::Tensor> flat = {at::cat(p).detach()};
    std::vector<std::vector<at::Tensor>> all(1);
    for (int r = 0; r < g.size(); ++r) all[0].push_back(at::empty_like(flat[0]));
    g->allgather(all, flat)->wait();
    for (int r = 1; r < g.size(); ++r) EXPECT_TRUE(all[0][r].equal(all[0][0])) << "rank " << r;
    auto state =
        torch_optim_state_dict(zero.local_optimizer()).toGenericDict().at("state").toGenericDict();
    for (const auto& kv : state) {
      EXPECT_EQ(kv.value().toGenericDict().at("step").toTensor().item<double>(), 7.0);
    }
  });
}

TEST(ZeroRedundancyOptimizerTest, MismatchedConstructionIsAnErrorNotAHang) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    expect_error(
        [&] {
          ZeroRedundancyOptimizer(make_params(kSizes),
                                  local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)),
                                  zero_options(g, g.rank() == 1));
        },
        "ZeroRedundancyOptimizer was built differently on different ranks (fingerprint 0 is ");
    // The same number of manual shards, different owners: each rank would broadcast what it
    // thinks it owns, pairing unrelated collectives.
    expect_error(
        [&] {
          ZeroOptions o = zero_options(g, false);
          o.params_per_rank = g.rank() == 0
                                  ? std::vector<std::vector<int64_t>>{{0, 1, 2, 3}, {4, 5, 6}}
                                  : std::vector<std::vector<int64_t>>{{0, 1, 2}, {3, 4, 5, 6}};
          ZeroRedundancyOptimizer(make_params(kSizes),
                                  local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)),
                                  o);
        },
        "ZeroRedundancyOptimizer was built differently on different ranks (fingerprint 0 is ");
  });
}

TEST(ZeroRedundancyOptimizerTest, AddParamGroupOnOneRankFailsEverywhere) {
  comm::testing::HarnessOptions o;
  o.timeout = std::chrono::seconds(3);
  run_ranks_as_threads(
      2,
      [](comm::Group& g) {
        std::vector<at::Tensor> p = make_params({4, 4});
        ZeroRedundancyOptimizer zero(
            p, local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)),
            zero_options(g, false));
        if (g.rank() == 0) {
          expect_error(
              [&] { zero.add_param_group(torch::optim::OptimizerParamGroup(make_params({3}))); },
              "add_param_group must be called on all ranks: only 1 of 2 ranks called it");
        } else {
          // This rank never calls add_param_group (and does not step: see the next test).
          std::this_thread::sleep_for(std::chrono::milliseconds(500));
        }
      },
      o);
}

TEST(ZeroRedundancyOptimizerTest, StepAfterAnotherRanksAddParamGroupFails) {
  comm::testing::HarnessOptions o;
  o.timeout = std::chrono::seconds(3);
  run_ranks_as_threads(
      2,
      [](comm::Group& g) {
        std::vector<at::Tensor> p = make_params({4, 4});
        ZeroRedundancyOptimizer zero(
            p, local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)),
            zero_options(g, false));
        if (g.rank() == 0) {
          expect_error(
              [&] { zero.add_param_group(torch::optim::OptimizerParamGroup(make_params({3}))); },
              "add_param_group must be called on all ranks");
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(500));
          for (auto& t : p) t.mutable_grad() = at::ones_like(t);
          expect_error([&] { zero.step(); },
                       "add_param_group must be called on all ranks: another rank called it");
        }
      },
      o);
}

}  // namespace
}  // namespace dtrain::optim
