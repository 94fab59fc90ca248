// DiLoCo with ZeroRedundancyOptimizer as its inner optimizer: the hierarchical recipe -- data
// parallel with ZeRO-sharded AdamW inside a replica (a node), DiLoCo's pseudo-gradients across
// replicas. 4 ranks as threads: replicas {0, 1} and {2, 3}; each replica averages its ranks'
// gradients, ZeRO shards AdamW's state over the replica, DiLoCo averages across replicas (ranks
// {0, 2} and {1, 3}). The result is, bit for bit, DiLoCo over plain AdamW on 2 replicas whose
// gradient is the mean of their ranks'.
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/object_collectives.h"
#include "comm/quorum.h"
#include "comm/testing/test_harness.h"
#include "optim/diloco.h"
#include "optim/functional/adapter.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::optim {
namespace {

using comm::testing::run_ranks_as_threads;
using ::testing::HasSubstr;

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

// Rank `rank`'s gradients at `step`, averaged over its replica (`within`) by an all-reduce: summed
// in rank order, then halved, as the reference does.
void set_replica_grads(std::vector<at::Tensor>& p, const comm::Group& within, int rank, int step) {
  for (size_t i = 0; i < p.size(); ++i) {
    std::vector<at::Tensor> g = {grad_of(p[i], i, rank, step)};
    within->allreduce(g)->wait();
    p[i].mutable_grad() = g[0] / 2;
  }
}

struct Replicas {
  comm::Group within, across;
};
Replicas make_replicas(const comm::Group& world) {
  auto within = comm::new_subgroups(world, 2);  // {0, 1}, {2, 3}
  TORCH_CHECK(within.ok(), within.status().message());
  auto across = comm::new_subgroups_by_enumeration(world, {{0, 2}, {1, 3}});
  TORCH_CHECK(across.ok(), across.status().message());
  return {within->mine, across->mine};
}

std::unique_ptr<ZeroRedundancyOptimizer> zero_over(const std::vector<at::Tensor>& p,
                                                   const comm::Group& within) {
  ZeroOptions zo;
  zo.group = within;
  return std::make_unique<ZeroRedundancyOptimizer>(
      p, local_optimizer<FunctionalOptimizerAdapter>("AdamW", adamw_options()), zo);
}

TEST(DiLoCoZeroTest, ZeroInsideAReplicaEqualsPlainAdamWReplicas) {
  const auto expected = reference();
  run_ranks_as_threads(4, [&](comm::Group& world) {
    const Replicas r = make_replicas(world);
    std::vector<at::Tensor> p = fresh();
    auto zero = zero_over(p, r.within);
    ZeroRedundancyOptimizer* zero_ptr = zero.get();
    DiLoCo opt(std::move(zero), diloco_options(r.across));
    for (int s = 0; s < kSteps; ++s) {
      set_replica_grads(p, r.within, world.rank(), s);
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

// Mid-round (step 6 of H = 4 rounds), each replica consolidates ZeRO's shards on its first rank,
// takes DiLoCo's state dict there and hands it to its other rank; a fresh DiLoCo over a fresh ZeRO
// loads it on every rank and goes on: the same bits as the straight run. On a rank that did not
// receive the consolidation, state_dict is ZeRO's error.
TEST(DiLoCoZeroTest, ConsolidatedStateDictResumesBitForBit) {
  const auto expected = reference();
  run_ranks_as_threads(4, [&](comm::Group& world) {
    const Replicas r = make_replicas(world);
    std::vector<at::Tensor> p = fresh();
    auto zero = zero_over(p, r.within);
    ZeroRedundancyOptimizer* zero_ptr = zero.get();
    DiLoCo opt(std::move(zero), diloco_options(r.across));
    for (int s = 0; s < 6; ++s) {
      set_replica_grads(p, r.within, world.rank(), s);
      opt.step();
    }
    zero_ptr->consolidate_state_dict(0);
    c10::IValue sd;
    if (r.within.rank() == 0) {
      sd = opt.state_dict();
    } else {
      try {
        (void)opt.state_dict();
        ADD_FAILURE() << "state_dict without the consolidated state";
      } catch (const c10::Error& e) {
        EXPECT_THAT(e.what_without_backtrace(), HasSubstr("consolidate_state_dict"));
      }
    }
    ASSERT_TRUE(comm::broadcast_object(r.within, sd, 0).ok());

    std::vector<at::Tensor> q;
    for (const auto& t : p) q.push_back(t.detach().clone().requires_grad_());
    DiLoCo resumed(zero_over(q, r.within), diloco_options(r.across));
    resumed.load_state_dict(sd);
    EXPECT_EQ(resumed.local_step(), 2);
    for (int s = 6; s < kSteps; ++s) {
      set_replica_grads(q, r.within, world.rank(), s);
      resumed.step();
    }
    const auto& want = expected[world.rank() / 2];
    for (size_t i = 0; i < q.size(); ++i) {
      EXPECT_TRUE(q[i].detach().equal(want[i])) << "rank " << world.rank() << " param " << i;
    }
  });
}

// Fault-tolerant DiLoCo heals a replica with a peer's whole state, which ZeRO shards: refused.
TEST(DiLoCoZeroTest, QuorumWithZeroInsideIsRefused) {
  comm::Lighthouse lighthouse;
  comm::QuorumOptions qo;
  qo.lighthouse_port = lighthouse.port();
  qo.replica_id = 0;
  absl::StatusOr<std::unique_ptr<comm::QuorumClient>> client = comm::QuorumClient::connect(qo);
  ASSERT_TRUE(client.ok()) << client.status();
  std::shared_ptr<comm::QuorumClient> shared = std::move(*client);
  run_ranks_as_threads(1, [&](comm::Group& g) {
    std::vector<at::Tensor> p = fresh();
    DiLoCoOptions o;
    o.quorum = shared;
    o.sync_every = 4;
    try {
      DiLoCo opt(zero_over(p, g), o);
      ADD_FAILURE() << "quorum accepted with ZeRO inside";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("quorum with a ZeroRedundancyOptimizer inside is not supported"));
    }
  });
}

}  // namespace
}  // namespace dtrain::optim
