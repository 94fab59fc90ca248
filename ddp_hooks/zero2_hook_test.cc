// ZeRO-2 (hook_with_zero2 + ZeroOptions::shard_gradients) against one process training on the
// whole batch, at world 2, 3 and 4, with every functional optimizer, uneven parameter sizes and a
// dominant embedding; clipping, no_sync, Join, checkpoints both ways, memory and bytes sent.
#include <filesystem>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/join.h"
#include "comm/object_collectives.h"
#include "comm/testing/counting_group.h"
#include "comm/testing/test_harness.h"
#include "ddp_hooks/testing/embedding_mlp.h"
#include "ddp_hooks/testing/fill_sin.h"
#include "ddp_hooks/zero_hook.h"

namespace dtrain::ddp_hooks {
namespace {

using comm::testing::run_ranks_as_threads;
using optim::FunctionalOptimizerAdapter;
using optim::local_optimizer;
using optim::ZeroOptions;
using optim::ZeroRedundancyOptimizer;
using ::testing::HasSubstr;

constexpr int kBatch = 12;  // divisible by 2, 3 and 4

// An embedding far larger than the rest (it dominates any whole-parameter partition), and
// parameters of uneven sizes.
struct NetImpl : EmbeddingMlpImpl {
  NetImpl() : EmbeddingMlpImpl(/*vocab=*/60, /*dim=*/8, /*hidden=*/5, /*out=*/3) {}
};
TORCH_MODULE(Net);

Net make_net() {
  Net net;
  fill_sin(*net, 0.5);
  return net;
}

torch::Tensor batch_x(int step) {
  return (torch::arange(kBatch, torch::kLong) * 7 + step * 5) % 60;
}
torch::Tensor batch_y(int step) {
  return torch::sin(torch::arange(kBatch * 3, torch::kFloat).view({kBatch, 3}) + step);
}
torch::Tensor rows(const torch::Tensor& t, const comm::Group& g) {
  const int64_t m = kBatch / g.size();
  return t.narrow(0, m * g.rank(), m);
}

struct Opt {
  std::string name;
  std::vector<std::pair<std::string, double>> options;
};
optim::OptionsDict dict(const Opt& o) {
  optim::OptionsDict d = optim::new_options_dict();
  for (const auto& [k, v] : o.options) d.insert(k, v);
  return d;
}
const Opt kAdam{"Adam", {{"lr", 0.01}, {"weight_decay", 0.01}}};

ZeroOptions zero1_options(const comm::Group& g) {
  ZeroOptions zo;
  zo.group = g;
  return zo;
}
ZeroOptions zero2_options(const comm::Group& g) {
  ZeroOptions zo = zero1_options(g);
  zo.shard_gradients = true;
  return zo;
}
DDPOptions ddp_options(const comm::Group& g, double cap_mb) {
  DDPOptions d;
  d.group = g;
  d.bucket_cap_mb = cap_mb;
  d.first_bucket_cap_mb = cap_mb;
  return d;
}
constexpr double kSmallBuckets = 0.0005;  // ~130 floats: the embedding alone, then the rest

double max_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, (a[i] - b[i]).abs().max().item<double>());
  return m;
}
std::vector<torch::Tensor> snapshot(Net& net) {
  std::vector<torch::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

// One process, the whole batch: parameters after each step (clipped to max_norm when > 0).
std::vector<std::vector<torch::Tensor>> reference(const Opt& o, int steps, double max_norm = 0) {
  Net net = make_net();
  FunctionalOptimizerAdapter opt(net->parameters(), o.name, dict(o));
  std::vector<std::vector<torch::Tensor>> out;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    torch::mse_loss(net->forward(batch_x(s)), batch_y(s)).backward();
    if (max_norm > 0) torch::nn::utils::clip_grad_norm_(net->parameters(), max_norm);
    opt.step();
    out.push_back(snapshot(net));
  }
  return out;
}

// One rank's model under DDP with a ZeroRedundancyOptimizer: ZeRO-2 (hook_with_zero2) by default,
// or ZeRO-1 (DDP's all-reduce, the optimizer stepping after backward).
enum class Stage { kOne, kTwo };
struct Rank {
  explicit Rank(const comm::Group& g, Stage stage = Stage::kTwo, const Opt& o = kAdam,
                double cap_mb = kSmallBuckets)
      : group(g),
        net(make_net()),
        ddp(net.ptr(), ddp_options(g, cap_mb)),
        zero(net->parameters(), local_optimizer<FunctionalOptimizerAdapter>(o.name, dict(o)),
             stage == Stage::kTwo ? zero2_options(g) : zero1_options(g)) {
    if (stage == Stage::kTwo) ddp.register_comm_hook(hook_with_zero2(ddp, zero));
  }
  // Forward and backward of step s on this rank's rows of the batch.
  void backward(int s) {
    ddp.forward([&] {
         return torch::mse_loss(net->forward(rows(batch_x(s), group)), rows(batch_y(s), group));
       })
        .backward();
  }
  void load_parameters(const std::vector<torch::Tensor>& values) {
    torch::NoGradGuard no_grad;
    auto p = net->parameters();
    for (size_t i = 0; i < p.size(); ++i) p[i].copy_(values[i]);
  }

  comm::Group group;
  Net net;
  DistributedDataParallel ddp;
  ZeroRedundancyOptimizer zero;
};

void check_matches_reference(int world, const Opt& o, double cap_mb, int steps = 4) {
  const auto expected = reference(o, steps);
  run_ranks_as_threads(world, [&](comm::Group& g) {
    Rank r(g, Stage::kTwo, o, cap_mb);
    for (int s = 0; s < steps; ++s) {
      r.zero.zero_grad();
      r.backward(s);
      for (auto& p : r.net->parameters())
        EXPECT_FALSE(p.grad().defined()) << "DDP kept a full gradient";
      r.zero.step();
      const double diff = max_diff(r.net->parameters(), expected[s]);
      EXPECT_LT(diff, 2e-6) << o.name << " world " << world << " rank " << g.rank() << " step "
                            << s;
    }
    EXPECT_GT(r.zero.local_state_bytes(), 0);
  });
}

TEST(Zero2Test, EveryFunctionalOptimizerMatchesOneProcessAtWorld2) {
  const std::vector<Opt> all = {
      {"SGD", {{"lr", 0.1}, {"momentum", 0.9}, {"weight_decay", 0.01}}},
      kAdam,
      {"AdamW", {{"lr", 0.01}}},
      {"Adagrad", {{"lr", 0.1}}},
      {"Adadelta", {{"lr", 1.0}}},
      {"Adamax", {{"lr", 0.01}}},
      {"RMSprop", {{"lr", 0.01}, {"momentum", 0.5}}},
      {"Rprop", {{"lr", 0.01}}},
  };
  for (const Opt& o : all) check_matches_reference(2, o, kSmallBuckets);
}

TEST(Zero2Test, Worlds3And4SmallAndDefaultBuckets) {
  for (int world : {3, 4}) {
    check_matches_reference(world, kAdam, kSmallBuckets);
    check_matches_reference(world, kAdam, 25);
  }
}

TEST(Zero2Test, ClipGradNormAcrossShardsMatchesTorchClipping) {
  constexpr double kMaxNorm = 0.05;  // below every step's norm: clipping acts
  const auto expected = reference(kAdam, 4, kMaxNorm);
  run_ranks_as_threads(3, [&](comm::Group& g) {
    Rank r(g);
    Net twin = make_net();  // one process, whole batch: the expected norm
    for (int s = 0; s < 4; ++s) {
      r.backward(s);
      const at::Tensor norm = r.zero.clip_grad_norm_(kMaxNorm);
      {
        torch::NoGradGuard no_grad;
        auto tp = twin->parameters();
        for (size_t i = 0; i < tp.size(); ++i) tp[i].copy_(r.net->parameters()[i]);
      }
      for (auto& p : twin->parameters()) p.mutable_grad() = torch::Tensor();
      torch::mse_loss(twin->forward(batch_x(s)), batch_y(s)).backward();
      const double want = torch::nn::utils::clip_grad_norm_(twin->parameters(), 1e9);
      EXPECT_NEAR(norm.item<double>(), want, 1e-5 * want) << "step " << s;
      EXPECT_GT(want, kMaxNorm);
      r.zero.step();
      EXPECT_LT(max_diff(r.net->parameters(), expected[s]), 2e-6)
          << "rank " << g.rank() << " step " << s;
    }
  });
}

TEST(Zero2Test, NoSyncAccumulatesThenOneReduction) {
  // Reference: two micro-batches per step, gradients summed.
  Net ref = make_net();
  FunctionalOptimizerAdapter ref_opt(ref->parameters(), "Adam", dict(kAdam));
  std::vector<std::vector<torch::Tensor>> expected;
  const int64_t half = kBatch / 2;
  for (int s = 0; s < 3; ++s) {
    ref_opt.zero_grad();
    for (int m = 0; m < 2; ++m) {
      torch::mse_loss(ref->forward(batch_x(s).narrow(0, m * half, half)),
                      batch_y(s).narrow(0, m * half, half))
          .backward();
    }
    ref_opt.step();
    expected.push_back(snapshot(ref));
  }
  run_ranks_as_threads(2, [&](comm::Group& g) {
    Rank r(g);
    const int64_t q = kBatch / 4;  // rank r's share of micro-batch m: rows m*6 + r*3 .. +3
    for (int s = 0; s < 3; ++s) {
      for (int m = 0; m < 2; ++m) {
        auto x = batch_x(s).narrow(0, m * half + g.rank() * q, q);
        auto y = batch_y(s).narrow(0, m * half + g.rank() * q, q);
        auto pass = [&] {
          r.ddp.forward([&] { return torch::mse_loss(r.net->forward(x), y); }).backward();
        };
        if (m == 0) {
          auto guard = r.ddp.no_sync();
          pass();
          EXPECT_TRUE(r.net->parameters()[0].grad().defined())
              << "no_sync keeps the local gradient";
        } else {
          pass();
        }
      }
      r.zero.step();
      EXPECT_LT(max_diff(r.net->parameters(), expected[s]), 2e-6)
          << "rank " << g.rank() << " step " << s;
    }
  });
}

TEST(Zero2Test, GradientMemoryIsAboutOneNth) {
  for (int world : {2, 4}) {
    run_ranks_as_threads(world, [&](comm::Group& g) {
      Rank r(g);
      int64_t total = 0;
      for (auto& p : r.net->parameters()) total += p.numel() * 4;
      r.backward(0);
      r.zero.step();
      const int64_t buckets = static_cast<int64_t>(r.ddp.bucket_indices().size());
      // 1/n of the gradients, plus at most one alignment (16 floats) of padding per bucket.
      EXPECT_LE(r.zero.gradient_bytes(), total / world + buckets * 16 * 4) << "world " << world;
      EXPECT_GE(r.zero.gradient_bytes(), total / world);
      for (auto& p : r.net->parameters()) EXPECT_FALSE(p.grad().defined());
      EXPECT_LT(r.zero.local_state_bytes(), 2 * total * 2 / world + buckets * 2 * 16 * 4);
      // ZeRO-1 keeps every gradient.
      Rank one(g, Stage::kOne);
      one.backward(0);
      one.zero.step();
      EXPECT_EQ(one.zero.gradient_bytes(), total);
    });
  }
}

// Per-rank bytes of one iteration, from the counting group: DDP alone, DDP + ZeRO-1, DDP + ZeRO-2.
TEST(Zero2Test, BytesPerIterationFollowTheFormulas) {
  for (int world : {2, 3, 4}) {
    run_ranks_as_threads(world, [&](comm::Group& plain) {
      auto counter = std::make_shared<comm::ByteCounter>();
      comm::Group g = comm::counting_group(plain, counter);
      const int n = world;
      int64_t model = 0;
      for (auto& p : make_net()->parameters()) model += p.numel() * 4;
      {
        Net net = make_net();
        DistributedDataParallel ddp(net.ptr(), ddp_options(g, kSmallBuckets));
        counter->reset();
        ddp.forward([&] {
             return torch::mse_loss(net->forward(rows(batch_x(0), g)), rows(batch_y(0), g));
           })
            .backward();
        // All-reduce: 2(n-1)/n of the model, rounded down per bucket.
        EXPECT_NEAR(counter->total_bytes(), 2 * model * (n - 1) / n, 64)
            << "DDP alone, world " << n;
      }
      for (Stage stage : {Stage::kOne, Stage::kTwo}) {
        Rank r(g, stage);
        counter->reset();
        r.backward(0);
        r.zero.step();
        const int64_t bytes = counter->total_bytes();
        if (stage == Stage::kOne) {
          EXPECT_NEAR(bytes, 3 * model * (n - 1) / n, 64) << "DDP + ZeRO-1, world " << n;
          continue;
        }
        // Reduce-scatter (n-1)/n and all-gather (n-1)/n of each padded bucket.
        const int64_t padding = static_cast<int64_t>(r.ddp.bucket_indices().size()) * n * 16 * 4;
        EXPECT_GE(bytes, 2 * model * (n - 1) / n - 64) << "DDP + ZeRO-2, world " << n;
        EXPECT_LE(bytes, 2 * (model + padding) * (n - 1) / n) << "DDP + ZeRO-2, world " << n;
      }
    });
  }
}

// Consolidated and sharded checkpoints of ZeRO-2 continue exactly in an unsharded optimizer and in
// ZeRO-1; ZeRO-1's consolidated state continues exactly in ZeRO-2.
TEST(Zero2Test, CheckpointsMoveBetweenZero2Zero1AndUnsharded) {
  const std::string dir = ::testing::TempDir() + "/zero2_sharded";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto expected = reference(kAdam, 4);
  run_ranks_as_threads(3, [&](comm::Group& g) {
    c10::IValue saved;
    std::vector<torch::Tensor> params_after_2;
    {
      Rank r(g);
      for (int s = 0; s < 2; ++s) {
        r.backward(s);
        r.zero.step();
      }
      r.zero.consolidate_state_dict(0);
      if (g.rank() == 0) saved = r.zero.state_dict();
      ASSERT_TRUE(r.zero.save_sharded(dir).ok());
      params_after_2 = snapshot(r.net);
    }
    if (g.rank() == 0) {  // unsharded, one process, whole batch
      Net net = make_net();
      FunctionalOptimizerAdapter opt(net->parameters(), "Adam", dict(kAdam));
      {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < params_after_2.size(); ++i)
          net->parameters()[i].copy_(params_after_2[i]);
      }
      opt.load_state_dict(saved);
      for (int s = 2; s < 4; ++s) {
        opt.zero_grad();
        torch::mse_loss(net->forward(batch_x(s)), batch_y(s)).backward();
        opt.step();
        EXPECT_LT(max_diff(net->parameters(), expected[s]), 2e-6) << "unsharded, step " << s;
      }
    }
    {  // ZeRO-1 (plain DDP + ZeroRedundancyOptimizer) from ZeRO-2's sharded checkpoint
      Rank r(g, Stage::kOne);
      r.load_parameters(params_after_2);
      ASSERT_TRUE(r.zero.load_sharded(dir).ok());
      for (int s = 2; s < 4; ++s) {
        r.zero.zero_grad();
        r.backward(s);
        r.zero.step();
        EXPECT_LT(max_diff(r.net->parameters(), expected[s]), 2e-6) << "ZeRO-1, step " << s;
      }
    }
    c10::IValue zero1_saved;
    {  // and back: ZeRO-1 after 2 steps, consolidated, continues in ZeRO-2
      Rank r(g, Stage::kOne);
      for (int s = 0; s < 2; ++s) {
        r.zero.zero_grad();
        r.backward(s);
        r.zero.step();
      }
      r.zero.consolidate_state_dict(0);
      zero1_saved = g.rank() == 0 ? r.zero.state_dict() : c10::IValue();
    }
    ASSERT_TRUE(comm::broadcast_object(g, zero1_saved, 0).ok());
    Rank r(g);
    r.load_parameters(params_after_2);
    r.zero.load_state_dict(zero1_saved);
    for (int s = 2; s < 4; ++s) {
      r.backward(s);
      r.zero.step();
      EXPECT_LT(max_diff(r.net->parameters(), expected[s]), 2e-6)
          << "ZeRO-2 from ZeRO-1, step " << s;
    }
  });
}

// Rank 1 runs out of inputs after 2 steps; inside a Join it still reduce-scatters (zeros), steps
// its ranges and all-gathers, so rank 0 trains on: from step 2 the gradient is rank 0's half
// divided by the initial world size (DDP's Join semantics), and both ranks end with that model.
TEST(Zero2Test, JoinWithUnevenInputs) {
  Net ref = make_net();
  FunctionalOptimizerAdapter ref_opt(ref->parameters(), "Adam", dict(kAdam));
  for (int s = 0; s < 5; ++s) {
    ref_opt.zero_grad();
    const int64_t half = kBatch / 2;
    at::Tensor loss = s < 2 ? torch::mse_loss(ref->forward(batch_x(s)), batch_y(s))
                            : 0.5 * torch::mse_loss(ref->forward(batch_x(s).narrow(0, 0, half)),
                                                    batch_y(s).narrow(0, 0, half));
    loss.backward();
    ref_opt.step();
  }
  const auto expected = snapshot(ref);
  run_ranks_as_threads(2, [&](comm::Group& g) {
    Rank r(g);
    const int steps = g.rank() == 0 ? 5 : 2;
    comm::Join join({&r.ddp, &r.zero});
    for (int s = 0; s < steps; ++s) {
      r.backward(s);
      r.zero.step();
    }
    join.finish();
    EXPECT_LT(max_diff(r.net->parameters(), expected), 2e-6) << "rank " << g.rank();
  });
}

TEST(Zero2Test, MisuseIsAClearError) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    auto error_of = [](const std::function<void()>& f) -> std::string {
      try {
        f();
      } catch (const c10::Error& e) {
        return e.what_without_backtrace();
      }
      return "no error";
    };
    {
      Net net = make_net();
      ZeroRedundancyOptimizer zero(
          net->parameters(), local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
          zero2_options(g));  // converted to the functional twin
      EXPECT_THAT(error_of([&] { zero.step(); }), HasSubstr("hook_with_zero2(ddp, zero)"));
    }
    {
      Net net = make_net();
      DDPOptions d = ddp_options(g, 25);
      d.gradient_as_bucket_view = true;
      DistributedDataParallel ddp(net.ptr(), d);
      ZeroRedundancyOptimizer zero(net->parameters(),
                                   local_optimizer<FunctionalOptimizerAdapter>("Adam", dict(kAdam)),
                                   zero2_options(g));
      EXPECT_THAT(error_of([&] { ddp.register_comm_hook(hook_with_zero2(ddp, zero)); }),
                  HasSubstr("gradient_as_bucket_view = false"));
    }
    {
      Rank one(g, Stage::kOne);
      EXPECT_THAT(error_of([&] { hook_with_zero2(one.ddp, one.zero); }),
                  HasSubstr("shard_gradients = true"));
      ZeroOptions both = zero2_options(g);
      both.overlap_with_ddp = true;
      EXPECT_THAT(error_of([&] {
                    ZeroRedundancyOptimizer z(
                        one.net->parameters(),
                        local_optimizer<FunctionalOptimizerAdapter>("Adam", dict(kAdam)), both);
                  }),
                  HasSubstr("choose one"));
    }
  });
}

}  // namespace
}  // namespace dtrain::ddp_hooks
