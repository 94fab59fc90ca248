// ZeroRedundancyOptimizer's semantics at the edges PyTorch users meet: a manual partition that
// leaves parameters to no rank, state indices that do not exist, state_dict() after a later step,
// what parameters_as_bucket_view does to parameter storage, step(closure)'s loss and update,
// optimizers that need whole parameters, and a failed step beside a store that stopped answering.
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/object_collectives.h"
#include "comm/process_group.h"
#include "comm/testing/test_harness.h"
#include "optim/functional/adapter.h"
#include "optim/functional/torch_state.h"
#include "optim/zero/testing/zero_test_util.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::optim {
namespace {

using comm::testing::run_ranks_as_threads;
using testing::clone_params;
using testing::expect_error;
using testing::kSizes;
using testing::make_params;
using testing::set_averaged_grads;
using testing::zero_options;

LocalOptimizer adam() {
  OptionsDict o = new_options_dict();
  o.insert("lr", 0.01);
  return local_optimizer<FunctionalOptimizerAdapter>("Adam", o);
}

// Parameters 3, 5 and 6 belong to no rank (PyTorch allows it: they are never stepped). The
// consolidated state still lists all seven in its param group, as PyTorch's state_dict() does, so
// it loads into an unsharded optimizer and back into ZeRO, and training continues exactly.
TEST(ZeroSemanticsTest, ManualPartitionLeavingParametersUnownedConsolidatesAndReloads) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    ZeroOptions o = zero_options(g, false);
    o.params_per_rank = {{0, 2}, {1, 4}};
    std::vector<at::Tensor> p = make_params(kSizes);
    ZeroRedundancyOptimizer zero(p, adam(), o);
    for (int s = 0; s < 3; ++s) {
      set_averaged_grads(g, p, s);
      zero.step();
    }
    zero.consolidate_state_dict(0);
    c10::IValue saved = g.rank() == 0 ? zero.state_dict() : c10::IValue();
    ASSERT_TRUE(comm::broadcast_object(g, saved, 0).ok());
    const auto groups = saved.toGenericDict().at("param_groups").toList();
    ASSERT_EQ(groups.size(), 1u);
    EXPECT_EQ(groups.get(0).toGenericDict().at("params").toIntVector(),
              (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
    std::vector<int64_t> with_state;
    for (const auto& kv : saved.toGenericDict().at("state").toGenericDict())
      with_state.push_back(kv.key().toInt());
    std::sort(with_state.begin(), with_state.end());
    EXPECT_EQ(with_state, (std::vector<int64_t>{0, 1, 2, 4}));

    // An unsharded optimizer over all seven takes it.
    std::vector<at::Tensor> plain_params = clone_params(p);
    std::unique_ptr<torch::optim::Optimizer> plain =
        adam().make({torch::optim::OptimizerParamGroup(plain_params)});
    load_optimizer_state_dict(*plain, saved);

    // ZeRO with the same partition continues exactly as the original.
    std::vector<at::Tensor> q = clone_params(p);
    ZeroRedundancyOptimizer resumed(q, adam(), o);
    resumed.load_state_dict(saved);
    for (int s = 3; s < 5; ++s) {
      set_averaged_grads(g, p, s);
      set_averaged_grads(g, q, s);
      zero.step();
      resumed.step();
    }
    for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(p[i].equal(q[i])) << "param " << i;
    // The unowned parameters never moved.
    const std::vector<at::Tensor> initial = make_params(kSizes);
    for (size_t i : {3, 5, 6}) EXPECT_TRUE(p[i].equal(initial[i])) << "param " << i;
  });
}

// State for a parameter index the optimizer does not have is an error (PyTorch: IndexError),
// not silently dropped.
TEST(ZeroSemanticsTest, StateForAnIndexOutOfRangeIsAnError) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    for (PartitionStrategy strategy :
         {PartitionStrategy::kSortedGreedy, PartitionStrategy::kFlat}) {
      ZeroOptions o = zero_options(g, false);
      o.strategy = strategy;
      std::vector<at::Tensor> p = make_params(kSizes);
      ZeroRedundancyOptimizer zero(p, adam(), o);
      set_averaged_grads(g, p, 0);
      zero.step();
      zero.consolidate_state_dict(0);
      c10::IValue saved = g.rank() == 0 ? zero.state_dict() : c10::IValue();
      ASSERT_TRUE(comm::broadcast_object(g, saved, 0).ok());
      for (int64_t bad : {int64_t{7}, int64_t{99}, int64_t{-1}}) {
        c10::IValue copy = saved.deepcopy();
        auto state = copy.toGenericDict().at("state").toGenericDict();
        state.insert(bad, state.at(0));
        expect_error([&] { zero.load_state_dict(copy); },
                     "has state for parameter index " + std::to_string(bad) +
                         " but this optimizer has 7 parameters");
      }
    }
  });
}

// state_dict() returns the state consolidated since the last step; after a later step it is an
// error (PyTorch returns the stale state: a checkpoint would pair new parameters with old state).
TEST(ZeroSemanticsTest, StateDictAfterALaterStepIsAnError) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    std::vector<at::Tensor> p = make_params(kSizes);
    ZeroRedundancyOptimizer zero(p, adam(), zero_options(g, false));
    set_averaged_grads(g, p, 0);
    zero.step();
    zero.consolidate_state_dict(0);
    if (g.rank() == 0) {
      EXPECT_TRUE(zero.state_dict().isGenericDict());
    }
    set_averaged_grads(g, p, 1);
    zero.step();
    if (g.rank() == 0) {
      expect_error([&] { zero.state_dict(); }, "is stale: step() ran after consolidate_state_dict");
    } else {
      expect_error([&] { zero.state_dict(); }, "has not been consolidated on this rank");
    }
  });
}

// parameters_as_bucket_view: on, a rank's parameters become views of one bucket; off, every
// parameter keeps its own storage. kFlat always lays parameters out in one flat buffer.
TEST(ZeroSemanticsTest, BucketViewDecidesParameterStorage) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    for (bool view : {false, true}) {
      std::vector<at::Tensor> p = make_params(kSizes);
      std::vector<const void*> before;
      for (const auto& t : p) before.push_back(t.data_ptr());
      ZeroRedundancyOptimizer zero(p, adam(), zero_options(g, view));
      for (int r = 0; r < g.size(); ++r) {
        const auto& mine = zero.partition().params_per_rank[r][0];
        for (int64_t i : mine) {
          const bool shared = p[i].storage().is_alias_of(p[mine.front()].storage());
          EXPECT_EQ(shared, view || i == mine.front()) << "view " << view << " param " << i;
          if (!view) {
            EXPECT_EQ(p[i].data_ptr(), before[i]) << "param " << i << " moved without bucket views";
          }
        }
      }
    }
    ZeroOptions flat = zero_options(g, false);
    flat.strategy = PartitionStrategy::kFlat;
    std::vector<at::Tensor> p = make_params(kSizes);
    ZeroRedundancyOptimizer zero(p, adam(), flat);
    for (const auto& t : p) EXPECT_TRUE(t.storage().is_alias_of(p[0].storage()));
  });
}

// step(closure) returns the closure's loss and applies exactly one update.
TEST(ZeroSemanticsTest, StepWithClosureReturnsItsLossAndStepsOnce) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    std::vector<at::Tensor> p = make_params(kSizes);
    std::vector<at::Tensor> ref = clone_params(p);
    std::unique_ptr<torch::optim::Optimizer> plain =
        adam().make({torch::optim::OptimizerParamGroup(ref)});
    ZeroRedundancyOptimizer zero(p, adam(), zero_options(g, true));
    for (int s = 0; s < 3; ++s) {
      int calls = 0;
      at::Tensor loss = zero.step([&] {
        ++calls;
        set_averaged_grads(g, p, s);
        return at::full({}, 2.5 + s + g.rank());
      });
      EXPECT_EQ(calls, 1);
      ASSERT_TRUE(loss.defined());
      EXPECT_EQ(loss.item<double>(), 2.5 + s + g.rank());
      set_averaged_grads(g, ref, s);
      plain->step();
      for (size_t i = 0; i < p.size(); ++i)
        EXPECT_TRUE(p[i].allclose(ref[i], 1e-6, 1e-7)) << "step " << s << " param " << i;
    }
  });
}

// Adafactor and Muon update each parameter whole (a factored second moment, orthogonalised
// matrices): ZeRO gives each to one rank whole (sorted-greedy, PyTorch's partition) and refuses a
// partition that cuts parameters into element ranges, on every rank, before any collective.
TEST(ZeroSemanticsTest, WholeParameterOptimizersRefuseTheFlatPartition) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    for (const char* name : {"Adafactor", "Muon"}) {
      SCOPED_TRACE(name);
      std::vector<at::Tensor> p;  // the same on every rank
      for (auto [r, c] : {std::pair{4, 3}, std::pair{5, 2}, std::pair{3, 3}}) {
        p.push_back(at::cos(at::arange(r * c, at::kFloat) * 0.7 + r).view({r, c}).requires_grad_());
      }
      ZeroOptions flat = zero_options(g, false);
      flat.strategy = PartitionStrategy::kFlat;
      expect_error(
          [&] {
            ZeroRedundancyOptimizer(
                p, local_optimizer<FunctionalOptimizerAdapter>(name, {{"lr", 0.01}}), flat);
          },
          std::string(name) +
              " updates each parameter whole, in its shape, but partition_strategy=kFlat");
      // Whole parameters per rank: it trains, as the optimizer alone would on each parameter.
      std::vector<at::Tensor> ref = clone_params(p);
      ZeroRedundancyOptimizer zero(
          p, local_optimizer<FunctionalOptimizerAdapter>(name, {{"lr", 0.01}}),
          zero_options(g, false));
      std::unique_ptr<torch::optim::Optimizer> plain =
          local_optimizer<FunctionalOptimizerAdapter>(name, {{"lr", 0.01}})
              .make({torch::optim::OptimizerParamGroup(ref)});
      for (int s = 0; s < 2; ++s) {
        set_averaged_grads(g, p, s);
        set_averaged_grads(g, ref, s);
        zero.step();
        plain->step();
      }
      for (size_t i = 0; i < p.size(); ++i)
        EXPECT_TRUE(p[i].allclose(ref[i], 1e-6, 1e-7)) << "param " << i;
    }
  });
}

// A rendezvous store whose `check` gets no answer while `silent` (its host's link cut: no reply,
// no reset).
class SilentStore : public c10d::HashStore {
 public:
  std::atomic<bool> silent{false};
  bool check(const std::vector<std::string>& keys) override {
    while (silent) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return HashStore::check(keys);
  }
};

// A failed step asks the store whether another rank's add_param_group caused it; a store that
// does not answer must not hold the step's own error (it did for ~15 minutes: issue 30's link-cut
// run). The error propagates within the 5 s bound.
TEST(ZeroSemanticsTest, AFailedStepDoesNotWaitForASilentStore) {
  auto store = c10::make_intrusive<SilentStore>();
  comm::InitOptions o;
  o.store = store;
  o.rank = 0;
  o.world_size = 1;
  absl::StatusOr<comm::Group> g = comm::init_process_group(o);
  ASSERT_TRUE(g.ok()) << g.status();
  std::vector<at::Tensor> p = make_params(kSizes);
  ZeroRedundancyOptimizer zero(p, adam(), zero_options(*g, true));
  store->silent = true;
  const auto start = std::chrono::steady_clock::now();
  try {
    zero.step([]() -> at::Tensor { throw std::runtime_error("the closure failed"); });
    ADD_FAILURE() << "step() should rethrow the closure's error";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("the closure failed"));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(8));
  store->silent = false;  // lets the abandoned question finish
}

}  // namespace
}  // namespace dtrain::optim
