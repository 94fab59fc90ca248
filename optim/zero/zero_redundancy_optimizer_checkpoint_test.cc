// ZeroRedundancyOptimizer's checkpoints: consolidate_state_dict into PyTorch's format, load_state_dict
// (from PyTorch, an unsharded optimizer, another world size or strategy; shape checks) and the sharded
// save/load. The rest of its tests are in zero_redundancy_optimizer_test.cc.
#include "optim/zero/zero_redundancy_optimizer.h"

#include <filesystem>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "comm/testing/test_harness.h"
#include "optim/functional/adapter.h"
#include "optim/functional/torch_state.h"
#include "optim/zero/testing/zero_test_util.h"

namespace dtrain::optim {
namespace {

using comm::testing::run_ranks_as_threads;
using ::testing::HasSubstr;
using namespace optim::testing;  // NOLINT: the shared test helpers

TEST(ZeroRedundancyOptimizerTest, FlatConsolidatesToPyTorchFormatAndCrossLoads) {
  // Flat at world 3 trains and consolidates; the state equals the unsharded optimizer's, and a
  // sorted-greedy ZeRO at world 2 continues from it like the unsharded one.
  c10::IValue saved;
  std::vector<at::Tensor> after;
  std::vector<at::Tensor> rp = make_params(kSizes);
  torch::optim::Adam reference(rp, torch::optim::AdamOptions(0.01));
  run_ranks_as_threads(3, [&](comm::Group& g) {
    std::vector<at::Tensor> zp = make_params(kSizes);
    ZeroOptions o = zero_options(g, false);
    o.strategy = PartitionStrategy::kFlat;
    o.flat_alignment = 4;
    ZeroRedundancyOptimizer zero(
        zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)), o);
    for (int step = 0; step < 4; ++step) {
      set_averaged_grads(g, zp, step);
      zero.step();
    }
    zero.consolidate_state_dict(1);
    if (g.rank() == 1) {
      saved = zero.state_dict();
      for (const auto& p : zp) after.push_back(p.detach().clone());
    }
  });
  for (int step = 0; step < 4; ++step) {
    for (size_t i = 0; i < rp.size(); ++i) {
      at::Tensor sum = at::zeros_like(rp[i]);
      for (int r = 0; r < 3; ++r) sum += grad_for(rp[i], r, step, i);
      rp[i].mutable_grad() = sum / 3;
    }
    reference.step();
  }
  auto want = torch_optim_state_dict(reference).toGenericDict().at("state").toGenericDict();
  auto got = saved.toGenericDict().at("state").toGenericDict();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& kv : want) {
    for (const auto& e : kv.value().toGenericDict()) {
      const c10::IValue& v = got.at(kv.key()).toGenericDict().at(e.key());
      if (e.value().isTensor()) {
        EXPECT_TRUE(v.toTensor().allclose(e.value().toTensor(), 1e-6, 1e-8))
            << kv.key().toInt() << " " << e.key().toStringRef();
        EXPECT_EQ(v.toTensor().sizes(), e.value().toTensor().sizes());
      }
    }
  }
  for (size_t i = 0; i < rp.size(); ++i)
    ASSERT_TRUE(after[i].allclose(rp[i].detach(), 1e-6, 1e-7)) << i;
  run_ranks_as_threads(2, [&](comm::Group& g) {
    std::vector<at::Tensor> zp = clone_params(after);
    std::vector<at::Tensor> ref_p = clone_params(after);
    torch::optim::Adam ref(ref_p, torch::optim::AdamOptions(0.01));
    load_torch_optim_state_dict(ref, saved);
    ZeroRedundancyOptimizer zero(
        zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
        zero_options(g, true));
    zero.load_state_dict(saved);
    ZeroOptions o = zero_options(g, false);
    o.strategy = PartitionStrategy::kFlat;
    std::vector<at::Tensor> fp = clone_params(after);
    ZeroRedundancyOptimizer flat(
        fp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)), o);
    flat.load_state_dict(saved);
    for (int step = 4; step < 7; ++step) {
      set_averaged_grads(g, zp, step);
      set_averaged_grads(g, fp, step);
      set_averaged_grads(g, ref_p, step);
      zero.step();
      flat.step();
      ref.step();
    }
    for (size_t i = 0; i < zp.size(); ++i) {
      EXPECT_TRUE(zp[i].allclose(ref_p[i], 1e-6, 1e-7)) << "sorted_greedy " << i;
      EXPECT_TRUE(fp[i].allclose(ref_p[i], 1e-6, 1e-7)) << "flat " << i;
    }
    expect_error([&] { flat.add_param_group(torch::optim::OptimizerParamGroup(make_params({3}))); },
                 "add_param_group is not supported with PartitionStrategy::kFlat yet");
  });
}

// A state tensor whose shape differs from its parameter's is refused by both strategies with the
// same words (kFlat used to reshape and cut it into this rank's slice, scrambling the state), on
// every rank (sorted-greedy used to refuse it on the parameter's owner only).
TEST(ZeroRedundancyOptimizerTest, LoadRefusesStateOfTheWrongShapeUnderEitherStrategy) {
  for (PartitionStrategy strategy : {PartitionStrategy::kSortedGreedy, PartitionStrategy::kFlat}) {
    for (const std::vector<int64_t>& bad :
         std::vector<std::vector<int64_t>>{{5, 4}, {21}, {4, 6}, {3, 5}}) {
      std::atomic<int> refused{0};
      run_ranks_as_threads(2, [&](comm::Group& g) {
        std::vector<at::Tensor> zp = {at::zeros({4, 5}).requires_grad_(),
                                      at::zeros({6}).requires_grad_()};
        ZeroOptions o = zero_options(g, false);
        o.strategy = strategy;
        ZeroRedundancyOptimizer zero(
            zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)), o);
        c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
        for (int64_t i = 0; i < 2; ++i) {
          c10::impl::GenericDict e(c10::StringType::get(), c10::AnyType::get());
          e.insert("step", at::scalar_tensor(1.0));
          e.insert("exp_avg", i == 0 ? at::ones(bad) : at::ones({6}));
          e.insert("exp_avg_sq", at::ones(zp[i].sizes()));
          state.insert(i, e);
        }
        c10::impl::GenericDict group(c10::StringType::get(), c10::AnyType::get());
        group.insert("lr", 0.01);
        group.insert("betas", c10::ivalue::Tuple::create({0.9, 0.999}));
        group.insert("eps", 1e-8);
        group.insert("weight_decay", 0.0);
        group.insert("amsgrad", false);
        group.insert("params", c10::List<int64_t>({0, 1}));
        c10::impl::GenericList groups(c10::AnyType::get());
        groups.push_back(group);
        c10::impl::GenericDict sd(c10::StringType::get(), c10::AnyType::get());
        sd.insert("state", state);
        sd.insert("param_groups", groups);
        try {
          zero.load_state_dict(sd);
        } catch (const c10::Error& e) {
          EXPECT_THAT(e.what_without_backtrace(), HasSubstr("has shape"));
          EXPECT_THAT(e.what_without_backtrace(), HasSubstr("[4, 5]"));
          ++refused;
        }
      });
      // Every rank checks every parameter's state, the ones it does not own too.
      EXPECT_EQ(refused.load(), 2)
          << (strategy == PartitionStrategy::kFlat ? "flat " : "sorted_greedy ")
          << c10::IntArrayRef(bad);
    }
  }
}

TEST(ZeroRedundancyOptimizerTest, ConsolidateEqualsUnshardedAndLoadsOnEveryRank) {
  run_ranks_as_threads(3, [](comm::Group& g) {
    std::vector<at::Tensor> zp = make_params(kSizes), rp = clone_params(zp);
    ZeroRedundancyOptimizer zero(
        zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
        zero_options(g, false));
    torch::optim::Adam reference(rp, torch::optim::AdamOptions(0.01));
    try {
      zero.state_dict();
      ADD_FAILURE() << "state_dict before consolidation must fail";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("has not been consolidated on this rank"));
    }
    for (int step = 0; step < 4; ++step) {
      set_averaged_grads(g, zp, step);
      set_averaged_grads(g, rp, step);
      zero.step();
      reference.step();
    }
    auto want = torch_optim_state_dict(reference).toGenericDict().at("state").toGenericDict();
    for (int to = 0; to < g.size(); ++to) {
      zero.consolidate_state_dict(to);
      if (g.rank() != to) continue;
      auto got = zero.state_dict().toGenericDict();
      auto state = got.at("state").toGenericDict();
      ASSERT_EQ(state.size(), want.size());
      for (const auto& kv : want) {
        auto w = kv.value().toGenericDict();
        auto s = state.at(kv.key()).toGenericDict();
        for (const auto& e : w) {
          if (e.value().isTensor()) {
            EXPECT_TRUE(s.at(e.key()).toTensor().allclose(e.value().toTensor(), 1e-6, 1e-8))
                << kv.key().toInt();
          }
        }
      }
      EXPECT_EQ(
          got.at("param_groups").toList().get(0).toGenericDict().at("params").toIntVector().size(),
          kSizes.size());
    }
    // Every rank loads the global state (here: the unsharded reference's) and continues in step.
    ZeroRedundancyOptimizer fresh(
        zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.5)),
        zero_options(g, true));
    fresh.load_state_dict(torch_optim_state_dict(reference));
    EXPECT_DOUBLE_EQ(fresh.param_groups()[0].options().get_lr(), 0.01);
    for (int step = 4; step < 7; ++step) {
      set_averaged_grads(g, zp, step);
      set_averaged_grads(g, rp, step);
      fresh.step();
      reference.step();
    }
    for (size_t i = 0; i < zp.size(); ++i) EXPECT_TRUE(zp[i].allclose(rp[i], 1e-6, 1e-7)) << i;
  });
}

// Steps 4..6 of one unsharded Adam(lr 0.01) from `params` and a global `state`, fed the averaged
// gradients a world of 3 ranks would produce: what a ZeRO resumed at world 3 must reach.
std::vector<at::Tensor> unsharded_continuation_at_world3(const std::vector<at::Tensor>& params,
                                                         const c10::IValue& state) {
  std::vector<at::Tensor> rp = clone_params(params);
  torch::optim::Adam reference(rp, torch::optim::AdamOptions(0.01));
  load_torch_optim_state_dict(reference, state);
  for (int step = 4; step < 7; ++step) {
    for (size_t i = 0; i < rp.size(); ++i) {
      at::Tensor sum = at::zeros_like(rp[i]);
      for (int r = 0; r < 3; ++r) sum += grad_for(rp[i], r, step, i);
      rp[i].mutable_grad() = sum / 3;
    }
    reference.step();
  }
  return rp;
}

TEST(ZeroRedundancyOptimizerTest, LoadsStateSavedAtAnotherWorldSize) {
  // World 2 trains and consolidates; world 3 loads it; both continue like one unsharded Adam.
  c10::IValue saved;
  std::vector<at::Tensor> after_save;
  run_ranks_as_threads(2, [&](comm::Group& g) {
    std::vector<at::Tensor> zp = make_params(kSizes);
    ZeroRedundancyOptimizer zero(
        zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
        zero_options(g, true));
    for (int step = 0; step < 4; ++step) {
      set_averaged_grads(g, zp, step);
      zero.step();
    }
    zero.consolidate_state_dict(0);
    if (g.rank() == 0) {
      saved = zero.state_dict();
      for (const auto& p : zp) after_save.push_back(p.detach().clone());
    }
  });
  const std::vector<at::Tensor> rp = unsharded_continuation_at_world3(after_save, saved);
  run_ranks_as_threads(3, [&](comm::Group& g) {
    std::vector<at::Tensor> zp = clone_params(after_save);
    ZeroRedundancyOptimizer zero(
        zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
        zero_options(g, false));
    zero.load_state_dict(saved);
    for (int step = 4; step < 7; ++step) {
      set_averaged_grads(g, zp, step);
      zero.step();
    }
    for (size_t i = 0; i < zp.size(); ++i) EXPECT_TRUE(zp[i].allclose(rp[i], 1e-5, 1e-6)) << i;
  });
}

// A fresh empty directory under the test's temporary directory.
std::string fresh_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

ZeroOptions with_strategy(comm::Group& g, PartitionStrategy strategy) {
  ZeroOptions o = zero_options(g, false);
  o.strategy = strategy;
  o.flat_alignment = 4;
  return o;
}

TEST(ZeroRedundancyOptimizerTest, ShardedSaveLoadsAtAnotherWorldSizeAndStrategy) {
  // World 2 trains 4 steps and saves shards (each rank only its own state); world 3 with the
  // other strategy loads them and continues exactly like one unsharded Adam loaded from the
  // consolidated state. Both directions: sorted-greedy -> flat and flat -> sorted-greedy.
  for (const auto& [from, to] :
       {std::pair{PartitionStrategy::kSortedGreedy, PartitionStrategy::kFlat},
        std::pair{PartitionStrategy::kFlat, PartitionStrategy::kSortedGreedy}}) {
    SCOPED_TRACE(from == PartitionStrategy::kFlat ? "flat -> sorted_greedy"
                                                  : "sorted_greedy -> flat");
    const std::string dir = fresh_dir("zero_sharded");
    c10::IValue consolidated;
    std::vector<at::Tensor> after_save;
    run_ranks_as_threads(2, [&](comm::Group& g) {
      std::vector<at::Tensor> zp = make_params(kSizes);
      ZeroRedundancyOptimizer zero(
          zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
          with_strategy(g, from));
      for (int step = 0; step < 4; ++step) {
        set_averaged_grads(g, zp, step);
        zero.step();
      }
      // The shard holds exactly what this rank owns, nothing of the other rank's.
      const checkpoint::ShardedState mine = zero.sharded_state();
      const auto owned = zero.owned_ranges();
      ASSERT_EQ(mine.params.size(), owned.size());
      for (const auto& [param, piece] : mine.params) {
        ASSERT_EQ(owned.count(param), 1u) << param;
        EXPECT_EQ(piece.range.begin, owned.at(param).begin);
        EXPECT_EQ(piece.range.end, owned.at(param).end);
      }
      ASSERT_TRUE(zero.save_sharded(dir, c10::IValue(int64_t{4})).ok());
      zero.consolidate_state_dict(0);
      if (g.rank() == 0) {
        consolidated = zero.state_dict();
        for (const auto& p : zp) after_save.push_back(p.detach().clone());
      }
    });
    const std::vector<at::Tensor> rp = unsharded_continuation_at_world3(after_save, consolidated);
    run_ranks_as_threads(3, [&](comm::Group& g) {
      std::vector<at::Tensor> zp = clone_params(after_save);
      ZeroRedundancyOptimizer zero(
          zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.5)),
          with_strategy(g, to));
      absl::StatusOr<c10::IValue> extra = zero.load_sharded(dir);
      ASSERT_TRUE(extra.ok()) << extra.status();
      EXPECT_EQ(extra->toInt(), 4);
      // The saved options (lr 0.01) replace the constructor's.
      EXPECT_DOUBLE_EQ(zero.param_groups()[0].options().get_lr(), 0.01);
      for (int step = 4; step < 7; ++step) {
        set_averaged_grads(g, zp, step);
        zero.step();
      }
      for (size_t i = 0; i < zp.size(); ++i) EXPECT_TRUE(zp[i].allclose(rp[i], 1e-6, 1e-7)) << i;
    });
  }
}

// A 0-d parameter's element-wise state is 0-d like its step: the flat strategy's 1-element slice
// of it must come back as one (it was loaded as a 0-d tensor beside a [1] parameter, and refused).
TEST(ZeroRedundancyOptimizerTest, ShardedSaveLoadsAZeroDimParameterUnderFlat) {
  const std::string dir = fresh_dir("zero_sharded_0d");
  auto params = [] {
    return std::vector<at::Tensor>{at::scalar_tensor(0.5).requires_grad_(),
                                   at::arange(6, at::kFloat).requires_grad_()};
  };
  c10::IValue before;
  run_ranks_as_threads(2, [&](comm::Group& g) {
    std::vector<at::Tensor> zp = params();
    ZeroRedundancyOptimizer zero(
        zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
        with_strategy(g, PartitionStrategy::kFlat));
    for (int step = 0; step < 2; ++step) {
      set_averaged_grads(g, zp, step);
      zero.step();
    }
    ASSERT_TRUE(zero.save_sharded(dir).ok());
    zero.consolidate_state_dict(0);
    if (g.rank() == 0) before = zero.state_dict();
  });
  run_ranks_as_threads(3, [&](comm::Group& g) {
    std::vector<at::Tensor> zp = params();
    ZeroRedundancyOptimizer zero(
        zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
        with_strategy(g, PartitionStrategy::kFlat));
    absl::StatusOr<c10::IValue> loaded = zero.load_sharded(dir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    zero.consolidate_state_dict(0);
    if (g.rank() != 0) return;
    const auto want = before.toGenericDict().at("state").toGenericDict();
    const auto got = zero.state_dict().toGenericDict().at("state").toGenericDict();
    for (const auto& kv : want) {
      for (const auto& e : kv.value().toGenericDict()) {
        if (!e.value().isTensor()) continue;
        const at::Tensor g_t = got.at(kv.key()).toGenericDict().at(e.key()).toTensor();
        EXPECT_EQ(g_t.sizes(), e.value().toTensor().sizes()) << e.key().toStringRef();
        EXPECT_TRUE(g_t.equal(e.value().toTensor())) << e.key().toStringRef();
      }
    }
  });
}

// Adafactor's factored variances are shaped [rows, 1] and [1, cols], not like their parameter:
// the sharded state and consolidation keep them as they are (they were reshaped to the parameter
// and refused).
TEST(ZeroRedundancyOptimizerTest, ShardedSaveLoadsAdafactorsFactoredState) {
  const std::string dir = fresh_dir("zero_sharded_adafactor");
  auto params = [] {
    return std::vector<at::Tensor>{at::ones({4, 3}).requires_grad_(),
                                   at::ones({2, 5}).requires_grad_()};
  };
  OptionsDict adafactor = new_options_dict();
  adafactor.insert("lr", 0.01);
  c10::IValue before;
  run_ranks_as_threads(2, [&](comm::Group& g) {
    std::vector<at::Tensor> zp = params();
    ZeroRedundancyOptimizer zero(
        zp, local_optimizer<FunctionalOptimizerAdapter>("Adafactor", adafactor),
        with_strategy(g, PartitionStrategy::kSortedGreedy));
    for (int step = 0; step < 2; ++step) {
      set_averaged_grads(g, zp, step);
      zero.step();
    }
    ASSERT_TRUE(zero.save_sharded(dir).ok());
    zero.consolidate_state_dict(0);
    if (g.rank() == 0) before = zero.state_dict();
  });
  run_ranks_as_threads(1, [&](comm::Group& g) {
    std::vector<at::Tensor> zp = params();
    ZeroRedundancyOptimizer zero(
        zp, local_optimizer<FunctionalOptimizerAdapter>("Adafactor", adafactor),
        with_strategy(g, PartitionStrategy::kSortedGreedy));
    absl::StatusOr<c10::IValue> loaded = zero.load_sharded(dir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    zero.consolidate_state_dict(0);
    const auto want = before.toGenericDict().at("state").toGenericDict();
    const auto got = zero.state_dict().toGenericDict().at("state").toGenericDict();
    ASSERT_EQ(got.size(), want.size());
    for (const auto& kv : want) {
      for (const auto& e : kv.value().toGenericDict()) {
        if (!e.value().isTensor()) continue;
        const at::Tensor g_t = got.at(kv.key()).toGenericDict().at(e.key()).toTensor();
        EXPECT_EQ(g_t.sizes(), e.value().toTensor().sizes()) << e.key().toStringRef();
        EXPECT_TRUE(g_t.equal(e.value().toTensor())) << e.key().toStringRef();
      }
    }
  });
}

TEST(ZeroRedundancyOptimizerTest, ShardedLoadErrors) {
  const std::string dir = fresh_dir("zero_sharded_errors");
  run_ranks_as_threads(2, [&](comm::Group& g) {
    std::vector<at::Tensor> zp = make_params(kSizes);
    ZeroRedundancyOptimizer zero(
        zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
        zero_options(g, false));
    absl::StatusOr<c10::IValue> none = zero.load_sharded(dir);
    EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound) << none.status();
    set_averaged_grads(g, zp, 0);
    zero.step();
    ASSERT_TRUE(zero.save_sharded(dir).ok());
    // Another model: a parameter with another shape, and one with more parameters.
    std::vector<int64_t> reshaped = kSizes;
    reshaped[4] = 41;
    ZeroRedundancyOptimizer other(
        make_params(reshaped), local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
        zero_options(g, false));
    absl::StatusOr<c10::IValue> bad = other.load_sharded(dir);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(bad.status().message()),
                HasSubstr("parameter 4 has shape [40] there but [41] here"));
    ZeroRedundancyOptimizer fewer(
        make_params({9, 7}), local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
        zero_options(g, false));
    bad = fewer.load_sharded(dir);
    EXPECT_THAT(std::string(bad.status().message()),
                HasSubstr("but this optimizer has 2 parameters"));
    // The same parameters and one more: every saved one fits, the group does not.
    std::vector<int64_t> more = kSizes;
    more.push_back(3);
    ZeroRedundancyOptimizer larger(
        make_params(more), local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
        zero_options(g, false));
    bad = larger.load_sharded(dir);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(bad.status().message()),
                HasSubstr("parameter group 0 has " + std::to_string(kSizes.size()) +
                          " parameters there, " + std::to_string(more.size()) + " here"));
    // A piece that is not the one this rank owns.
    checkpoint::ShardedState wrong = zero.sharded_state();
    auto& piece = wrong.params.begin()->second;
    piece.range.end -= 1;
    expect_error([&] { zero.load_sharded_state(wrong); }, "in the given state, but rank");
    // A NaN in a piece is refused naming the parameter's global index, not its local one.
    checkpoint::ShardedState poisoned = zero.sharded_state();
    auto& [param, saved] = *poisoned.params.rbegin();
    at::Tensor exp_avg = saved.entries.at("exp_avg").toTensor().clone();
    exp_avg.view(-1)[0] = NAN;
    saved.entries.insert_or_assign("exp_avg", exp_avg);
    expect_error([&] { zero.load_sharded_state(poisoned); },
                 "state 'exp_avg' of parameter " + std::to_string(param) + " holds nan");
  });
}

}  // namespace
}  // namespace dtrain::optim
