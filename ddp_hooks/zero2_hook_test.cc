// ZeRO-2 (hook_with_zero2 + ZeroOptions::shard_gradients) against one process training on the
// whole batch, at world 2, 3 and 4, with every functional optimizer, uneven parameter sizes and a
// dominant embedding; clipping, no_sync, Join, checkpoints both ways, memory and bytes sent.
#include <filesystem>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/counting_group.h"
#include "comm/join.h"
#include "comm/object_collectives.h"
#include "comm/test_harness.h"
#include "ddp_hooks/zero_hook.h"

namespace dtrain::ddp_hooks {
namespace {

using ::testing::HasSubstr;
using comm::testing::run_ranks_as_threads;
using optim::FunctionalOptimizerAdapter;
using optim::local_optimizer;
using optim::ZeroOptions;
using optim::ZeroRedundancyOptimizer;

constexpr int kBatch = 12;  // divisible by 2, 3 and 4

// An embedding far larger than the rest (it dominates any whole-parameter partition), and
// parameters of uneven sizes.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    emb = register_module("emb", torch::nn::Embedding(60, 8));
    fc1 = register_module("fc1", torch::nn::Linear(8, 5));
    fc2 = register_module("fc2", torch::nn::Linear(5, 3));
  }
  torch::Tensor forward(const torch::Tensor& idx) { return fc2(torch::tanh(fc1(emb(idx)))); }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

Net make_net() {
  Net net;
  torch::NoGradGuard no_grad;
  int k = 0;
  for (auto& p : net->parameters()) p.copy_(torch::sin(torch::arange(p.numel()).view(p.sizes()) * 0.3 + k++) * 0.5);
  return net;
}

torch::Tensor batch_x(int step) { return (torch::arange(kBatch, torch::kLong) * 7 + step * 5) % 60; }
torch::Tensor batch_y(int step) { return torch::sin(torch::arange(kBatch * 3, torch::kFloat).view({kBatch, 3}) + step); }
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

ZeroOptions zero2_options(const comm::Group& g) {
  ZeroOptions zo;
  zo.group = g;
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

void check_matches_reference(int world, const Opt& o, double cap_mb, int steps = 4) {
  const auto expected = reference(o, steps);
  run_ranks_as_threads(world, [&](comm::Group& g) {
    Net net = make_net();
    DistributedDataParallel ddp(net.ptr(), ddp_options(g, cap_mb));
    ZeroRedundancyOptimizer zero(net->parameters(), local_optimizer<FunctionalOptimizerAdapter>(o.name, dict(o)),
                                 zero2_options(g));
    ddp.register_comm_hook(hook_with_zero2(ddp, zero));
    for (int s = 0; s < steps; ++s) {
      zero.zero_grad();
      ddp.forward([&] { return torch::mse_loss(net->forward(rows(batch_x(s), g)), rows(batch_y(s), g)); }).backward();
      for (auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined()) << "DDP kept a full gradient";
      zero.step();
      const double diff = max_diff(net->parameters(), expected[s]);
      EXPECT_LT(diff, 2e-6) << o.name << " world " << world << " rank " << g.rank() << " step " << s;
    }
    EXPECT_GT(zero.local_state_bytes(), 0);
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
    Net net = make_net();
    Net twin = make_net();  // one process, whole batch: the expected norm
    DistributedDataParallel ddp(net.ptr(), ddp_options(g, kSmallBuckets));
    ZeroRedundancyOptimizer zero(net->parameters(), local_optimizer<FunctionalOptimizerAdapter>("Adam", dict(kAdam)),
                                 zero2_options(g));
    ddp.register_comm_hook(hook_with_zero2(ddp, zero));
    for (int s = 0; s < 4; ++s) {
      ddp.forward([&] { return torch::mse_loss(net->forward(rows(batch_x(s), g)), rows(batch_y(s), g)); }).backward();
      const at::Tensor norm = zero.clip_grad_norm_(kMaxNorm);
      {
        torch::NoGradGuard no_grad;
        auto tp = twin->parameters();
        for (size_t i = 0; i < tp.size(); ++i) tp[i].copy_(net->parameters()[i]);
      }
      for (auto& p : twin->parameters()) p.mutable_grad() = torch::Tensor();
      torch::mse_loss(twin->forward(batch_x(s)), batch_y(s)).backward();
      const double want = torch::nn::utils::clip_grad_norm_(twin->parameters(), 1e9);
      EXPECT_NEAR(norm.item<double>(), want, 1e-5 * want) << "step " << s;
      EXPECT_GT(want, kMaxNorm);
      zero.step();
      EXPECT_LT(max_diff(net->parameters(), expected[s]), 2e-6) << "rank " << g.rank() << " step " << s;
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
      torch::mse_loss(ref->forward(batch_x(s).narrow(0, m * half, half)), batch_y(s).narrow(0, m * half, half))
          .backward();
    }
    ref_opt.step();
    expected.push_back(snapshot(ref));
  }
  run_ranks_as_threads(2, [&](comm::Group& g) {
    Net net = make_net();
    DistributedDataParallel ddp(net.ptr(), ddp_options(g, kSmallBuckets));
    ZeroRedundancyOptimizer zero(net->parameters(), local_optimizer<FunctionalOptimizerAdapter>("Adam", dict(kAdam)),
                                 zero2_options(g));
    ddp.register_comm_hook(hook_with_zero2(ddp, zero));
    const int64_t q = kBatch / 4;  // rank r's share of micro-batch m: rows m*6 + r*3 .. +3
    for (int s = 0; s < 3; ++s) {
      for (int m = 0; m < 2; ++m) {
        auto x = batch_x(s).narrow(0, m * half + g.rank() * q, q);
        auto y = batch_y(s).narrow(0, m * half + g.rank() * q, q);
        if (m == 0) {
          auto guard = ddp.no_sync();
          ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
          EXPECT_TRUE(net->parameters()[0].grad().defined()) << "no_sync keeps the local gradient";
        } else {
          ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
        }
      }
      zero.step();
      EXPECT_LT(max_diff(net->parameters(), expected[s]), 2e-6) << "rank " << g.rank() << " step " << s;
    }
  });
}

TEST(Zero2Test, GradientMemoryIsAboutOneNth) {
  for (int world : {2, 4}) {
    run_ranks_as_threads(world, [&](comm::Group& g) {
      Net net = make_net();
      int64_t total = 0;
      for (auto& p : net->parameters()) total += p.numel() * 4;
      DistributedDataParallel ddp(net.ptr(), ddp_options(g, kSmallBuckets));
      ZeroRedundancyOptimizer zero(net->parameters(), local_optimizer<FunctionalOptimizerAdapter>("Adam", dict(kAdam)),
                                   zero2_options(g));
      ddp.register_comm_hook(hook_with_zero2(ddp, zero));
      ddp.forward([&] { return torch::mse_loss(net->forward(rows(batch_x(0), g)), rows(batch_y(0), g)); }).backward();
      zero.step();
      const int64_t buckets = static_cast<int64_t>(ddp.bucket_indices().size());
      // 1/n of the gradients, plus at most one alignment (16 floats) of padding per bucket.
      EXPECT_LE(zero.gradient_bytes(), total / world + buckets * 16 * 4) << "world " << world;
      EXPECT_GE(zero.gradient_bytes(), total / world);
      for (auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
      EXPECT_LT(zero.local_state_bytes(), 2 * total * 2 / world + buckets * 2 * 16 * 4);
    });
  }
}

// Per-rank bytes of one iteration, from the counting group: DDP alone, DDP + ZeRO-1, DDP + ZeRO-2.
TEST(Zero2Test, BytesPerIterationFollowTheFormulas) {
  for (int world : {2, 3, 4}) {
    run_ranks_as_threads(world, [&](comm::Group& plain) {
      auto counter = std::make_shared<comm::ByteCounter>();
      comm::Group g = comm::counting_group(plain, counter);
      auto iteration = [&](Net& net, DistributedDataParallel& ddp, torch::optim::Optimizer* opt) {
        counter->reset();
        ddp.forward([&] { return torch::mse_loss(net->forward(rows(batch_x(0), g)), rows(batch_y(0), g)); }).backward();
        if (opt != nullptr) opt->step();
        return counter->total_bytes();
      };
      const int n = world;
      int64_t model = 0;
      {
        Net net = make_net();
        for (auto& p : net->parameters()) model += p.numel() * 4;
        DistributedDataParallel ddp(net.ptr(), ddp_options(g, kSmallBuckets));
        // All-reduce: 2(n-1)/n of the model, rounded down per bucket.
        const int64_t bytes = iteration(net, ddp, nullptr);
        EXPECT_NEAR(bytes, 2 * model * (n - 1) / n, 64) << "DDP alone, world " << n;
      }
      {
        Net net = make_net();
        DistributedDataParallel ddp(net.ptr(), ddp_options(g, kSmallBuckets));
        ZeroOptions zo;
        zo.group = g;
        ZeroRedundancyOptimizer zero(net->parameters(), local_optimizer<FunctionalOptimizerAdapter>("Adam", dict(kAdam)),
                                     zo);
        const int64_t bytes = iteration(net, ddp, &zero);
        EXPECT_NEAR(bytes, 3 * model * (n - 1) / n, 64) << "DDP + ZeRO-1, world " << n;
      }
      {
        Net net = make_net();
        DistributedDataParallel ddp(net.ptr(), ddp_options(g, kSmallBuckets));
        ZeroRedundancyOptimizer zero(net->parameters(), local_optimizer<FunctionalOptimizerAdapter>("Adam", dict(kAdam)),
                                     zero2_options(g));
        ddp.register_comm_hook(hook_with_zero2(ddp, zero));
        const int64_t bytes = iteration(net, ddp, &zero);
        // Reduce-scatter (n-1)/n and all-gather (n-1)/n of each padded bucket.
        const int64_t buckets = static_cast<int64_t>(ddp.bucket_indices().size());
        const int64_t padding = buckets * n * 16 * 4;
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
    auto local = [] { return local_optimizer<FunctionalOptimizerAdapter>("Adam", dict(kAdam)); };
    auto step_ddp = [&](Net& net, DistributedDataParallel& ddp, int s) {
      ddp.forward([&] { return torch::mse_loss(net->forward(rows(batch_x(s), g)), rows(batch_y(s), g)); }).backward();
    };
    c10::IValue saved;
    std::vector<torch::Tensor> params_after_2;
    {
      Net net = make_net();
      DistributedDataParallel ddp(net.ptr(), ddp_options(g, kSmallBuckets));
      ZeroRedundancyOptimizer zero(net->parameters(), local(), zero2_options(g));
      ddp.register_comm_hook(hook_with_zero2(ddp, zero));
      for (int s = 0; s < 2; ++s) {
        step_ddp(net, ddp, s);
        zero.step();
      }
      zero.consolidate_state_dict(0);
      if (g.rank() == 0) saved = zero.state_dict();
      ASSERT_TRUE(zero.save_sharded(dir).ok());
      params_after_2 = snapshot(net);
    }
    auto load_params = [&](Net& net) {
      torch::NoGradGuard no_grad;
      auto p = net->parameters();
      for (size_t i = 0; i < p.size(); ++i) p[i].copy_(params_after_2[i]);
    };
    if (g.rank() == 0) {  // unsharded, one process, whole batch
      Net net = make_net();
      load_params(net);
      FunctionalOptimizerAdapter opt(net->parameters(), "Adam", dict(kAdam));
      opt.load_state_dict(saved);
      for (int s = 2; s < 4; ++s) {
        opt.zero_grad();
        torch::mse_loss(net->forward(batch_x(s)), batch_y(s)).backward();
        opt.step();
        EXPECT_LT(max_diff(net->parameters(), expected[s]), 2e-6) << "unsharded, step " << s;
      }
    }
    c10::IValue zero1_saved;
    {  // ZeRO-1 (plain DDP + ZeroRedundancyOptimizer) from ZeRO-2's sharded checkpoint
      Net net = make_net();
      load_params(net);
      DistributedDataParallel ddp(net.ptr(), ddp_options(g, kSmallBuckets));
      ZeroOptions zo;
      zo.group = g;
      ZeroRedundancyOptimizer zero(net->parameters(), local(), zo);
      ASSERT_TRUE(zero.load_sharded(dir).ok());
      for (int s = 2; s < 4; ++s) {
        zero.zero_grad();
        step_ddp(net, ddp, s);
        zero.step();
        EXPECT_LT(max_diff(net->parameters(), expected[s]), 2e-6) << "ZeRO-1, step " << s;
      }
    }
    {  // and back: ZeRO-1 after 2 steps, consolidated, continues in ZeRO-2
      Net net = make_net();
      DistributedDataParallel ddp(net.ptr(), ddp_options(g, kSmallBuckets));
      ZeroOptions zo;
      zo.group = g;
      ZeroRedundancyOptimizer zero(net->parameters(), local(), zo);
      for (int s = 0; s < 2; ++s) {
        zero.zero_grad();
        step_ddp(net, ddp, s);
        zero.step();
      }
      zero.consolidate_state_dict(0);
      zero1_saved = g.rank() == 0 ? zero.state_dict() : c10::IValue();
    }
    ASSERT_TRUE(comm::broadcast_object(g, zero1_saved, 0).ok());
    Net net = make_net();
    load_params(net);
    DistributedDataParallel ddp(net.ptr(), ddp_options(g, kSmallBuckets));
    ZeroRedundancyOptimizer zero(net->parameters(), local(), zero2_options(g));
    ddp.register_comm_hook(hook_with_zero2(ddp, zero));
    zero.load_state_dict(zero1_saved);
    for (int s = 2; s < 4; ++s) {
      step_ddp(net, ddp, s);
      zero.step();
      EXPECT_LT(max_diff(net->parameters(), expected[s]), 2e-6) << "ZeRO-2 from ZeRO-1, step " << s;
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
    Net net = make_net();
    DistributedDataParallel ddp(net.ptr(), ddp_options(g, kSmallBuckets));
    ZeroRedundancyOptimizer zero(net->parameters(), local_optimizer<FunctionalOptimizerAdapter>("Adam", dict(kAdam)),
                                 zero2_options(g));
    ddp.register_comm_hook(hook_with_zero2(ddp, zero));
    const int steps = g.rank() == 0 ? 5 : 2;
    comm::Join join({&ddp, &zero});
    for (int s = 0; s < steps; ++s) {
      ddp.forward([&] { return torch::mse_loss(net->forward(rows(batch_x(s), g)), rows(batch_y(s), g)); }).backward();
      zero.step();
    }
    join.finish();
    EXPECT_LT(max_diff(net->parameters(), expected), 2e-6) << "rank " << g.rank();
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
      ZeroRedundancyOptimizer zero(net->parameters(), local_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
                                   zero2_options(g));  // converted to the functional twin
      EXPECT_THAT(error_of([&] { zero.step(); }), HasSubstr("hook_with_zero2(ddp, zero)"));
    }
    {
      Net net = make_net();
      DDPOptions d = ddp_options(g, 25);
      d.gradient_as_bucket_view = true;
      DistributedDataParallel ddp(net.ptr(), d);
      ZeroRedundancyOptimizer zero(net->parameters(), local_optimizer<FunctionalOptimizerAdapter>("Adam", dict(kAdam)),
                                   zero2_options(g));
      EXPECT_THAT(error_of([&] { ddp.register_comm_hook(hook_with_zero2(ddp, zero)); }),
                  HasSubstr("gradient_as_bucket_view = false"));
    }
    {
      Net net = make_net();
      DistributedDataParallel ddp(net.ptr(), ddp_options(g, 25));
      ZeroOptions zo;
      zo.group = g;
      ZeroRedundancyOptimizer zero(net->parameters(), local_optimizer<FunctionalOptimizerAdapter>("Adam", dict(kAdam)),
                                   zo);
      EXPECT_THAT(error_of([&] { hook_with_zero2(ddp, zero); }), HasSubstr("shard_gradients = true"));
      ZeroOptions both = zero2_options(g);
      both.overlap_with_ddp = true;
      EXPECT_THAT(error_of([&] {
                    ZeroRedundancyOptimizer z(net->parameters(),
                                              local_optimizer<FunctionalOptimizerAdapter>("Adam", dict(kAdam)), both);
                  }),
                  HasSubstr("choose one"));
    }
  });
}

}  // namespace
}  // namespace dtrain::ddp_hooks
