#include "optim/zero_redundancy_optimizer.h"

#include <atomic>
#include <filesystem>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "comm/coalesced.h"
#include "comm/test_harness.h"
#include "optim/torch_state.h"

namespace dtrain::optim {
namespace {

using ::testing::HasSubstr;
using comm::testing::run_ranks_as_threads;

// Deterministic data without the global generator (rank threads would race on it).
std::vector<at::Tensor> make_params(const std::vector<int64_t>& sizes) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < sizes.size(); ++i) {
    out.push_back(at::cos(at::arange(sizes[i], at::kFloat) * 0.37 + static_cast<double>(i)).requires_grad_());
  }
  return out;
}
at::Tensor grad_for(const at::Tensor& p, int rank, int step, size_t i) {
  return at::sin(at::arange(p.numel(), at::kFloat) * (0.1 + 0.05 * rank) + step + 0.3 * i).view(p.sizes());
}

// Each rank has its own gradients; DDP would average them: do that here.
void set_averaged_grads(comm::Group& g, std::vector<at::Tensor>& params, int step) {
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].requires_grad()) {
      params[i].mutable_grad() = at::Tensor();
      continue;
    }
    grads.push_back(grad_for(params[i], g.rank(), step, i));
  }
  comm::all_reduce_coalesced(g, grads).wait();
  size_t k = 0;
  for (auto& p : params) {
    if (p.requires_grad()) p.mutable_grad() = grads[k++].div_(g.size());
  }
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

ZeroOptions zero_options(comm::Group& g, bool bucket_view) {
  ZeroOptions o;
  o.group = g;
  o.parameters_as_bucket_view = bucket_view;
  return o;
}

const std::vector<int64_t> kSizes = {9, 7, 5, 3, 40, 12, 1};

void expect_error(const std::function<void()>& f, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "expected: " << message;
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr(message));
  }
}


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
      return std::make_pair(local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9)),
                            std::make_unique<torch::optim::SGD>(ref, torch::optim::SGDOptions(0.1).momentum(0.9)));
    });
    parity(3, bucket_view, [](std::vector<at::Tensor>& ref) {
      return std::make_pair(local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
                            std::make_unique<torch::optim::Adam>(ref, torch::optim::AdamOptions(0.01)));
    });
    parity(2, bucket_view, [](std::vector<at::Tensor>& ref) {
      return std::make_pair(local_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(0.01)),
                            std::make_unique<torch::optim::AdamW>(ref, torch::optim::AdamWOptions(0.01)));
    });
  }
}

TEST(ZeroRedundancyOptimizerTest, FunctionalLocalOptimizerThroughTheAdapter) {
  // The overlapped step+sync path, in one chunk and in many (tiny chunks: a few parameters each).
  for (int64_t chunk_bytes : {int64_t{8} << 20, int64_t{32}}) {
    for (bool bucket_view : {false, true}) {
      SCOPED_TRACE(std::to_string(chunk_bytes) + (bucket_view ? " bucket view" : " per parameter"));
      parity(3, bucket_view, [](std::vector<at::Tensor>& ref) {
        OptionsDict o = new_options_dict();
        o.insert("lr", 0.01);
        return std::make_pair(local_optimizer<FunctionalOptimizerAdapter>("Adam", o),
                              std::make_unique<torch::optim::Adam>(ref, torch::optim::AdamOptions(0.01)));
      }, chunk_bytes);
    }
  }
}

TEST(ZeroRedundancyOptimizerTest, FlatStrategyMatchesUnsharded) {
  for (int world : {2, 3}) {
    SCOPED_TRACE(world);
    parity(world, false, [](std::vector<at::Tensor>& ref) {
      return std::make_pair(local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9)),
                            std::make_unique<torch::optim::SGD>(ref, torch::optim::SGDOptions(0.1).momentum(0.9)));
    }, int64_t{8} << 20, PartitionStrategy::kFlat);
    parity(world, false, [](std::vector<at::Tensor>& ref) {
      OptionsDict o = new_options_dict();
      o.insert("lr", 0.01);
      return std::make_pair(local_optimizer<FunctionalOptimizerAdapter>("Adam", o),
                            std::make_unique<torch::optim::Adam>(ref, torch::optim::AdamOptions(0.01)));
    }, int64_t{8} << 20, PartitionStrategy::kFlat);
  }
}

TEST(ZeroRedundancyOptimizerTest, FlatStrategyBalanceWithADominantParameter) {
  run_ranks_as_threads(3, [](comm::Group& g) {
    // One parameter holds ~95% of the elements: sorted-greedy cannot balance it, flat can.
    std::vector<int64_t> sizes = {200000, 3000, 3000, 2000, 1000, 500};
    ZeroOptions o = zero_options(g, false);
    o.strategy = PartitionStrategy::kFlat;
    ZeroRedundancyOptimizer flat(make_params(sizes), local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions()), o);
    ZeroRedundancyOptimizer greedy(make_params(sizes), local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions()),
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
    ZeroRedundancyOptimizer zero(zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)), o);
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
        EXPECT_TRUE(v.toTensor().allclose(e.value().toTensor(), 1e-6, 1e-8)) << kv.key().toInt() << " " << e.key().toStringRef();
        EXPECT_EQ(v.toTensor().sizes(), e.value().toTensor().sizes());
      }
    }
  }
  for (size_t i = 0; i < rp.size(); ++i) ASSERT_TRUE(after[i].allclose(rp[i].detach(), 1e-6, 1e-7)) << i;
  run_ranks_as_threads(2, [&](comm::Group& g) {
    std::vector<at::Tensor> zp = clone_params(after);
    std::vector<at::Tensor> ref_p = clone_params(after);
    torch::optim::Adam ref(ref_p, torch::optim::AdamOptions(0.01));
    load_torch_optim_state_dict(ref, saved);
    ZeroRedundancyOptimizer zero(zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)), zero_options(g, true));
    zero.load_state_dict(saved);
    ZeroOptions o = zero_options(g, false);
    o.strategy = PartitionStrategy::kFlat;
    std::vector<at::Tensor> fp = clone_params(after);
    ZeroRedundancyOptimizer flat(fp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)), o);
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
// same words (kFlat used to reshape and cut it into this rank's slice, scrambling the state).
TEST(ZeroRedundancyOptimizerTest, LoadRefusesStateOfTheWrongShapeUnderEitherStrategy) {
  for (PartitionStrategy strategy : {PartitionStrategy::kSortedGreedy, PartitionStrategy::kFlat}) {
    for (const std::vector<int64_t>& bad : std::vector<std::vector<int64_t>>{{5, 4}, {21}, {4, 6}, {3, 5}}) {
      std::atomic<int> refused{0};
      run_ranks_as_threads(2, [&](comm::Group& g) {
        std::vector<at::Tensor> zp = {at::zeros({4, 5}).requires_grad_(), at::zeros({6}).requires_grad_()};
        ZeroOptions o = zero_options(g, false);
        o.strategy = strategy;
        ZeroRedundancyOptimizer zero(zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)), o);
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
      // kFlat: both ranks hold a slice of the [4, 5] parameter; sorted-greedy: its one owner.
      EXPECT_EQ(refused.load(), strategy == PartitionStrategy::kFlat ? 2 : 1)
          << (strategy == PartitionStrategy::kFlat ? "flat " : "sorted_greedy ") << c10::IntArrayRef(bad);
    }
  }
}

TEST(ZeroRedundancyOptimizerTest, StepWithClosureAndLrScheduler) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    std::vector<at::Tensor> p = make_params({4, 4});
    ZeroRedundancyOptimizer zero(p, local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(1.0)), zero_options(g, false));
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
      ZeroRedundancyOptimizer zero(p, local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)), zero_options(g, true));
      for (int r = 0; r < world; ++r) EXPECT_EQ(zero.partition().numel_per_rank[r], 24);
      // A second group, with one large frozen parameter among them: still balanced.
      std::vector<at::Tensor> more = make_params(sizes);
      more.push_back(at::zeros({48 * world}));  // frozen (no requires_grad)
      zero.add_param_group(torch::optim::OptimizerParamGroup(more));
      const int64_t total = 48 * world + 48 * world;
      for (int r = 0; r < world; ++r) EXPECT_LE(zero.partition().numel_per_rank[r], total / world + 48 * world);
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
    ZeroRedundancyOptimizer zero_a(split(a, 3, 0.05), local_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(0.01)),
                                   zero_options(g, false));
    ZeroRedundancyOptimizer zero_b(std::vector<at::Tensor>(b.begin(), b.begin() + 3),
                                   local_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(0.01)), zero_options(g, true));
    zero_b.add_param_group(torch::optim::OptimizerParamGroup(std::vector<at::Tensor>(b.begin() + 3, b.end()),
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

// Trains a few steps; returns the unsharded reference's state for comparison.
TEST(ZeroRedundancyOptimizerTest, ConsolidateEqualsUnshardedAndLoadsOnEveryRank) {
  run_ranks_as_threads(3, [](comm::Group& g) {
    std::vector<at::Tensor> zp = make_params(kSizes), rp = clone_params(zp);
    ZeroRedundancyOptimizer zero(zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)), zero_options(g, false));
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
            EXPECT_TRUE(s.at(e.key()).toTensor().allclose(e.value().toTensor(), 1e-6, 1e-8)) << kv.key().toInt();
          }
        }
      }
      EXPECT_EQ(got.at("param_groups").toList().get(0).toGenericDict().at("params").toIntVector().size(), kSizes.size());
    }
    // Every rank loads the global state (here: the unsharded reference's) and continues in step.
    ZeroRedundancyOptimizer fresh(zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.5)), zero_options(g, true));
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
    ZeroRedundancyOptimizer zero(zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)), zero_options(g, true));
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
    ZeroRedundancyOptimizer zero(zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)), zero_options(g, false));
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
  for (const auto& [from, to] : {std::pair{PartitionStrategy::kSortedGreedy, PartitionStrategy::kFlat},
                                 std::pair{PartitionStrategy::kFlat, PartitionStrategy::kSortedGreedy}}) {
    SCOPED_TRACE(from == PartitionStrategy::kFlat ? "flat -> sorted_greedy" : "sorted_greedy -> flat");
    const std::string dir = fresh_dir("zero_sharded");
    c10::IValue consolidated;
    std::vector<at::Tensor> after_save;
    run_ranks_as_threads(2, [&](comm::Group& g) {
      std::vector<at::Tensor> zp = make_params(kSizes);
      ZeroRedundancyOptimizer zero(zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
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
      ZeroRedundancyOptimizer zero(zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.5)),
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

TEST(ZeroRedundancyOptimizerTest, ShardedLoadErrors) {
  const std::string dir = fresh_dir("zero_sharded_errors");
  run_ranks_as_threads(2, [&](comm::Group& g) {
    std::vector<at::Tensor> zp = make_params(kSizes);
    ZeroRedundancyOptimizer zero(zp, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
                                 zero_options(g, false));
    absl::StatusOr<c10::IValue> none = zero.load_sharded(dir);
    EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound) << none.status();
    set_averaged_grads(g, zp, 0);
    zero.step();
    ASSERT_TRUE(zero.save_sharded(dir).ok());
    // Another model: a parameter with another shape, and one with more parameters.
    std::vector<int64_t> reshaped = kSizes;
    reshaped[4] = 41;
    ZeroRedundancyOptimizer other(make_params(reshaped),
                                  local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
                                  zero_options(g, false));
    absl::StatusOr<c10::IValue> bad = other.load_sharded(dir);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr("parameter 4 has shape [40] there but [41] here"));
    ZeroRedundancyOptimizer fewer(make_params({9, 7}),
                                  local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
                                  zero_options(g, false));
    bad = fewer.load_sharded(dir);
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr("but this optimizer has 2 parameters"));
    // A piece that is not the one this rank owns.
    checkpoint::ShardedState wrong = zero.sharded_state();
    auto& piece = wrong.params.begin()->second;
    piece.range.end -= 1;
    expect_error([&] { zero.load_sharded_state(wrong); }, "in the given state, but rank");
  });
}

TEST(ZeroRedundancyOptimizerTest, NonDefaultSubgroup) {
  run_ranks_as_threads(4, [](comm::Group& world) {
    auto sub = comm::new_subgroups(world, 2);
    ASSERT_TRUE(sub.ok());
    std::vector<at::Tensor> zp = make_params(kSizes), rp = clone_params(zp);
    ZeroRedundancyOptimizer zero(zp, local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)),
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
    expect_error([&] { ZeroRedundancyOptimizer(std::vector<at::Tensor>{}, sgd(), zero_options(g, false)); },
                 "ZeroRedundancyOptimizer got an empty parameter list");
    expect_error([&] {
      ZeroRedundancyOptimizer({at::zeros({2}).requires_grad_(), at::zeros({2}, at::kDouble).requires_grad_()}, sgd(),
                              zero_options(g, false));
    }, "only supports using the same dense type for all parameters but got both Float cpu tensor and Double cpu tensor");
    expect_error([&] {
      ZeroRedundancyOptimizer({at::zeros({2, 2}).to_sparse()}, sgd(), zero_options(g, false));
    }, "only supports using the same dense type for all parameters but got sparse");
    ZeroOptions manual = zero_options(g, false);
    manual.params_per_rank = {{0}};
    expect_error([&] { ZeroRedundancyOptimizer(make_params({2, 2}), sgd(), manual); },
                 "`params_per_rank` must have length equal to the world size");
    manual.params_per_rank = {{0}, {5}};
    expect_error([&] { ZeroRedundancyOptimizer(make_params({2, 2}), sgd(), manual); },
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
    ZeroRedundancyOptimizer zero(p, local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
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
    auto state = torch_optim_state_dict(zero.local_optimizer()).toGenericDict().at("state").toGenericDict();
    for (const auto& kv : state) {
      EXPECT_EQ(kv.value().toGenericDict().at("step").toTensor().item<double>(), 7.0);
    }
  });
}

TEST(ZeroRedundancyOptimizerTest, MismatchedConstructionIsAnErrorNotAHang) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    expect_error([&] {
      ZeroRedundancyOptimizer(make_params(kSizes), local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)),
                              zero_options(g, g.rank() == 1));
    }, "ZeroRedundancyOptimizer was built differently on rank");
  });
}

TEST(ZeroRedundancyOptimizerTest, AddParamGroupOnOneRankFailsEverywhere) {
  comm::testing::HarnessOptions o;
  o.timeout = std::chrono::seconds(3);
  run_ranks_as_threads(2, [](comm::Group& g) {
    std::vector<at::Tensor> p = make_params({4, 4});
    ZeroRedundancyOptimizer zero(p, local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)), zero_options(g, false));
    if (g.rank() == 0) {
      expect_error([&] { zero.add_param_group(torch::optim::OptimizerParamGroup(make_params({3}))); },
                   "add_param_group must be called on all ranks: only 1 of 2 ranks called it");
    } else {
      // This rank never calls add_param_group (and does not step: see the next test).
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  }, o);
}

TEST(ZeroRedundancyOptimizerTest, StepAfterAnotherRanksAddParamGroupFails) {
  comm::testing::HarnessOptions o;
  o.timeout = std::chrono::seconds(3);
  run_ranks_as_threads(2, [](comm::Group& g) {
    std::vector<at::Tensor> p = make_params({4, 4});
    ZeroRedundancyOptimizer zero(p, local_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)), zero_options(g, false));
    if (g.rank() == 0) {
      expect_error([&] { zero.add_param_group(torch::optim::OptimizerParamGroup(make_params({3}))); },
                   "add_param_group must be called on all ranks");
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      for (auto& t : p) t.mutable_grad() = at::ones_like(t);
      expect_error([&] { zero.step(); }, "add_param_group must be called on all ranks: another rank called it");
    }
  }, o);
}

}  // namespace
}  // namespace dtrain::optim
