// DiLoCo with ZeroRedundancyOptimizer as its inner optimizer: the hierarchical recipe -- data
// parallel with ZeRO-sharded AdamW inside a replica (a node), DiLoCo's pseudo-gradients across
// replicas. 4 ranks as threads: replicas {0, 1} and {2, 3}; each replica averages its ranks'
// gradients, ZeRO shards AdamW's state over the replica, DiLoCo averages across replicas (ranks
// {0, 2} and {1, 3}). The result is, bit for bit, DiLoCo over plain AdamW on 2 replicas whose
// gradient is the mean of their ranks'.
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"
#include "optim/diloco.h"
#include "optim/functional/adapter.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::optim {
namespace {

using comm::testing::run_ranks_as_threads;

constexpr int kSteps = 12;  // 3 rounds of H = 4

std::vector<at::Tensor> init() {
  return {at::cos(at::arange(300, at::kFloat)) * 0.5, at::sin(at::arange(64, at::kFloat)) * 0.5,
          at::cos(at::arange(40, at::kFloat) * 0.3)};
}

std::vector<at::Tensor> fresh() {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : init()) out.push_back(t.clone().requires_grad_());
  return out;
}

// Rank `rank`'s gradient at `step` (a function of the parameters, so the trajectories matter).
at::Tensor grad_of(const at::Tensor& p, size_t i, int rank, int step) {
  return at::sin(p.detach() * (1.0 + 0.1 * rank) + step * 0.37 + static_cast<double>(i)) +
         0.01 * rank;
}

OptionsDict adamw_options() {
  OptionsDict o = new_options_dict();
  o.insert("lr", 0.02);
  o.insert("weight_decay", 0.01);
  return o;
}

DiLoCoOptions diloco_options(const comm::Group& across) {
  DiLoCoOptions o;
  o.group = across;
  o.sync_every = 4;
  return o;
}

// The reference: 2 replicas (threads), DiLoCo over plain AdamW, gradient = the mean of the
// replica's two ranks' (in the order the all-reduce sums them: rank 2r, then 2r + 1, halved).
std::vector<std::vector<at::Tensor>> reference() {
  std::vector<std::vector<at::Tensor>> out(2);
  run_ranks_as_threads(2, [&](comm::Group& g) {
    std::vector<at::Tensor> p = fresh();
    DiLoCo opt(std::make_unique<FunctionalOptimizerAdapter>(p, "AdamW", adamw_options()),
               diloco_options(g));
    for (int s = 0; s < kSteps; ++s) {
      for (size_t i = 0; i < p.size(); ++i) {
        p[i].mutable_grad() =
            (grad_of(p[i], i, 2 * g.rank(), s) + grad_of(p[i], i, 2 * g.rank() + 1, s)) / 2;
      }
      opt.step();
    }
    for (const auto& t : p) out[g.rank()].push_back(t.detach().clone());
  });
  return out;
}

TEST(DiLoCoZeroTest, ZeroInsideAReplicaEqualsPlainAdamWReplicas) {
  const auto expected = reference();
  run_ranks_as_threads(4, [&](comm::Group& world) {
    auto within = comm::new_subgroups(world, 2);  // {0, 1}, {2, 3}
    ASSERT_TRUE(within.ok()) << within.status();
    auto across = comm::new_subgroups_by_enumeration(world, {{0, 2}, {1, 3}});
    ASSERT_TRUE(across.ok()) << across.status();
    std::vector<at::Tensor> p = fresh();
    ZeroOptions zo;
    zo.group = within->mine;
    auto zero = std::make_unique<ZeroRedundancyOptimizer>(
        p, local_optimizer<FunctionalOptimizerAdapter>("AdamW", adamw_options()), zo);
    ZeroRedundancyOptimizer* zero_ptr = zero.get();
    DiLoCo opt(std::move(zero), diloco_options(across->mine));
    for (int s = 0; s < kSteps; ++s) {
      for (size_t i = 0; i < p.size(); ++i) {
        // Summed in rank order over the replica, then halved: the reference's arithmetic.
        std::vector<at::Tensor> g = {grad_of(p[i], i, world.rank(), s)};
        within->mine->allreduce(g)->wait();
        p[i].mutable_grad() = g[0] / 2;
      }
      opt.step();
    }
    // Each rank holds only its shard of AdamW's state, and the replica agrees on every parameter.
    const int64_t all_state = 2 * 404 * 4;  // exp_avg and exp_avg_sq of 404 float32 elements
    EXPECT_GT(zero_ptr->local_state_bytes(), 0);
    EXPECT_LT(zero_ptr->local_state_bytes(), all_state);
    const auto& want = expected[world.rank() / 2];
    for (size_t i = 0; i < p.size(); ++i) {
      EXPECT_TRUE(p[i].detach().equal(want[i]))
          << "rank " << world.rank() << " param " << i << " max diff "
          << (p[i].detach() - want[i]).abs().max().item<float>();
    }
  });
}

}  // namespace
}  // namespace dtrain::optim
