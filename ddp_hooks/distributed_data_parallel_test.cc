#include "ddp_hooks/distributed_data_parallel.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/testing/test_harness.h"
#include "ddp_hooks/default_hooks.h"

namespace dtrain::ddp_hooks {
namespace {

using comm::testing::run_ranks_as_threads;
using ::testing::HasSubstr;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
    spare = register_module("spare", torch::nn::Linear(8, 3));  // used only when asked
    register_buffer("scale", torch::ones({1}));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_spare = false) {
    auto h = torch::relu(fc1(x));
    auto y = fc2(h) * named_buffers()["scale"];
    return use_spare ? y + spare(h) : y;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, spare{nullptr};
};
TORCH_MODULE(Net);

// Deterministic weights (rank threads must not race on the global generator); `salt` makes
// ranks start differently, to check DDP's broadcast.
Net make_net(double salt) {
  Net net;
  torch::NoGradGuard no_grad;
  int k = 0;
  for (auto& p : net->parameters())
    p.copy_(torch::sin(torch::arange(p.numel()).view(p.sizes()) * 0.3 + k++ + salt));
  return net;
}

torch::Tensor batch_x() { return torch::cos(torch::arange(32, torch::kFloat).view({8, 4}) * 0.7); }
torch::Tensor batch_y() { return torch::sin(torch::arange(24, torch::kFloat).view({8, 3})); }

// Gradients of a single-process run on the whole batch.
std::vector<torch::Tensor> reference_grads(bool use_spare = false) {
  Net net = make_net(0);
  torch::mse_loss(net->forward(batch_x(), use_spare), batch_y()).backward();
  std::vector<torch::Tensor> g;
  for (auto& p : net->parameters())
    g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return g;
}

// `spare` is unused unless asked for: these tests let DDP find unused parameters.
DDPOptions options_for(comm::Group& g, bool view, double cap_mb) {
  DDPOptions o;
  o.group = g;
  o.find_unused_parameters = true;
  o.gradient_as_bucket_view = view;
  o.bucket_cap_mb = cap_mb;
  o.first_bucket_cap_mb = cap_mb;
  return o;
}

TEST(DistributedDataParallelTest, AveragedGradientsEqualTheFullBatch) {
  const auto want = reference_grads();
  for (bool view : {false, true}) {
    for (double cap : {1e-6, 25.0}) {
      SCOPED_TRACE(std::string(view ? "bucket view" : "copy") + " cap " + std::to_string(cap));
      run_ranks_as_threads(2, [&](comm::Group& g) {
        Net net =
            make_net(g.rank() == 0 ? 0 : 5);  // rank 1 starts elsewhere: DDP broadcasts rank 0's
        DistributedDataParallel ddp(net.ptr(), options_for(g, view, cap));
        EXPECT_EQ(ddp.bucket_indices().size(), cap < 1 ? 6u : 1u);
        for (int iter = 0; iter < 2; ++iter) {  // twice: state resets between iterations
          net->zero_grad();
          auto x = batch_x().narrow(0, 4 * g.rank(), 4), y = batch_y().narrow(0, 4 * g.rank(), 4);
          ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
          auto params = net->parameters();
          for (size_t i = 0; i < params.size(); ++i) {
            if (!want[i].defined()) continue;
            ASSERT_TRUE(params[i].grad().defined()) << i;
            EXPECT_TRUE(params[i].grad().allclose(want[i], 1e-5, 1e-6))
                << "iter " << iter << " param " << i;
          }
        }
      });
    }
  }
}

TEST(DistributedDataParallelTest, FindUnusedParameters) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    Net net = make_net(0);
    DDPOptions o = options_for(g, false, 25);
    o.find_unused_parameters = true;
    DistributedDataParallel ddp(net.ptr(), o);
    auto x = batch_x().narrow(0, 4 * g.rank(), 4), y = batch_y().narrow(0, 4 * g.rank(), 4);
    // Only rank 1 uses `spare`: its gradient is rank 1's divided by 2 on both ranks.
    ddp.forward([&] { return torch::mse_loss(net->forward(x, g.rank() == 1), y); }).backward();
    ASSERT_TRUE(net->spare->weight.grad().defined());
    std::vector<torch::Tensor> w = {net->spare->weight.grad().clone()};
    std::vector<std::vector<torch::Tensor>> all(1,
                                                {torch::empty_like(w[0]), torch::empty_like(w[0])});
    g->allgather(all, w)->wait();
    EXPECT_TRUE(all[0][0].equal(all[0][1]));
    // Unused on every rank: .grad is left untouched.
    net->zero_grad(/*set_to_none=*/false);  // LibTorch 2.x defaults to set_to_none=true
    net->spare->weight.mutable_grad().fill_(7);
    ddp.forward([&] { return torch::mse_loss(net->forward(x, false), y); }).backward();
    EXPECT_TRUE(net->spare->weight.grad().eq(7).all().item<bool>());
  });
}

TEST(DistributedDataParallelTest, UnusedParametersWithoutDetectionNameThemAtTheNextForward) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    Net net = make_net(0);
    DDPOptions o = options_for(g, false, 25);
    o.find_unused_parameters = false;
    DistributedDataParallel ddp(net.ptr(), o);
    auto x = batch_x().narrow(0, 4 * g.rank(), 4), y = batch_y().narrow(0, 4 * g.rank(), 4);
    ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
    try {
      ddp.forward([&] { return torch::mse_loss(net->forward(x), y); });
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("Parameters which did not receive grad for rank"));
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("spare.weight"));
    }
  });
}

TEST(DistributedDataParallelTest, NoSyncAccumulatesLocally) {
  // Two micro-batches under no_sync and one synced equal the sum of three averaged micro-batches.
  Net ref = make_net(0);
  for (int m = 0; m < 3; ++m) {
    for (int r = 0; r < 2; ++r) {
      auto x = batch_x().narrow(0, 4 * r, 4) * (m + 1), y = batch_y().narrow(0, 4 * r, 4);
      (torch::mse_loss(ref->forward(x), y) / 2).backward();
    }
  }
  run_ranks_as_threads(2, [&](comm::Group& g) {
    Net net = make_net(0);
    DistributedDataParallel ddp(net.ptr(), options_for(g, true, 25));
    auto y = batch_y().narrow(0, 4 * g.rank(), 4);
    {
      auto guard = ddp.no_sync();
      for (int m = 0; m < 2; ++m) {
        auto x = batch_x().narrow(0, 4 * g.rank(), 4) * (m + 1);
        ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
      }
    }
    auto x = batch_x().narrow(0, 4 * g.rank(), 4) * 3;
    ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
    auto a = net->parameters(), b = ref->parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      if (!b[i].grad().defined()) continue;
      EXPECT_TRUE(a[i].grad().allclose(b[i].grad(), 1e-5, 1e-6)) << i;
    }
  });
}

TEST(DistributedDataParallelTest, HooksAndTheirRules) {
  const auto want = reference_grads();
  run_ranks_as_threads(2, [&](comm::Group& g) {
    Net net = make_net(0);
    DistributedDataParallel ddp(net.ptr(), options_for(g, false, 25));
    ddp.register_comm_hook(std::make_unique<CompressHook>(g, at::kHalf));
    try {
      ddp.register_comm_hook(std::make_unique<NoOpHook>());
      ADD_FAILURE() << "a second hook must be refused";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("can only be called once"));
    }
    auto x = batch_x().narrow(0, 4 * g.rank(), 4), y = batch_y().narrow(0, 4 * g.rank(), 4);
    ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
    auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!want[i].defined()) continue;
      EXPECT_TRUE(params[i].grad().allclose(want[i], 2e-3, 2e-3))
          << "fp16 rounding only, param " << i;
      EXPECT_EQ(params[i].grad().scalar_type(), at::kFloat);
    }
  });
  run_ranks_as_threads(2, [&](comm::Group& g) {
    Net net = make_net(0);
    DistributedDataParallel ddp(net.ptr(), options_for(g, false, 25));
    ddp.register_comm_hook(std::make_unique<NoOpHook>());
    auto x = batch_x().narrow(0, 4 * g.rank(), 4), y = batch_y().narrow(0, 4 * g.rank(), 4);
    ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
    // No communication: each rank keeps its own half-batch gradient.
    Net local = make_net(0);
    torch::mse_loss(local->forward(x), y).backward();
    EXPECT_TRUE(net->fc1->weight.grad().allclose(local->fc1->weight.grad()));
  });
}

TEST(DistributedDataParallelTest, BuffersBroadcastFromRankZero) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    Net net = make_net(0);
    DistributedDataParallel ddp(net.ptr(), options_for(g, false, 25));
    net->named_buffers()["scale"].fill_(g.rank() == 0 ? 2.0 : 7.0);
    auto x = batch_x().narrow(0, 4 * g.rank(), 4), y = batch_y().narrow(0, 4 * g.rank(), 4);
    ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
    EXPECT_EQ(net->named_buffers()["scale"].item<float>(), 2.0f);
  });
}

// Rank 0 has 3 batches, rank 1 has 5. With Join, rank 0 shadows steps 4 and 5 (zeros), so
// rank 1's gradient there is its own divided by the initial world size (or by the one rank still
// training, with divide_by_initial_world_size=false); at the end both ranks hold rank 1's model.
// Reproduce that with one process and plain SGD.
void check_join_with_uneven_inputs(bool divide_by_initial_world_size) {
  auto x_for = [](int rank, int step) {
    return batch_x().narrow(0, 4 * rank, 4) * (1 + 0.1 * step);
  };
  auto y_for = [](int rank) { return batch_y().narrow(0, 4 * rank, 4); };
  Net ref = make_net(0);
  {
    torch::optim::SGD sgd(ref->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 5; ++step) {
      sgd.zero_grad();
      const int active = step >= 3 ? 1 : 2;
      const double divisor = divide_by_initial_world_size ? 2 : active;
      for (int r = 0; r < 2; ++r) {
        if (r == 0 && step >= 3) continue;
        (torch::mse_loss(ref->forward(x_for(r, step)), y_for(r)) / divisor).backward();
      }
      sgd.step();
    }
  }
  run_ranks_as_threads(2, [&](comm::Group& g) {
    Net net = make_net(0);
    DistributedDataParallel ddp(net.ptr(), options_for(g, false, 1e-6));
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    comm::JoinOptions join_options;
    join_options.divide_by_initial_world_size = divide_by_initial_world_size;
    comm::Join join({&ddp}, join_options);
    const int inputs = g.rank() == 0 ? 3 : 5;
    for (int step = 0; step < inputs; ++step) {
      sgd.zero_grad();
      ddp.forward(
             [&] { return torch::mse_loss(net->forward(x_for(g.rank(), step)), y_for(g.rank())); })
          .backward();
      sgd.step();
    }
    join.finish();
    auto a = net->parameters(), b = ref->parameters();
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(a[i].allclose(b[i], 1e-5, 1e-6)) << "rank " << g.rank() << " param " << i;
  });
}

TEST(DistributedDataParallelTest, JoinWithUnevenInputsMatchesTheExpectedTrajectory) {
  check_join_with_uneven_inputs(/*divide_by_initial_world_size=*/true);
}

TEST(DistributedDataParallelTest, JoinDividingByTheActiveRanksMatchesTheExpectedTrajectory) {
  check_join_with_uneven_inputs(/*divide_by_initial_world_size=*/false);
}

struct OtherImpl : torch::nn::Module {
  OtherImpl(int out) { fc = register_module("fc", torch::nn::Linear(4, out)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Other);

TEST(DistributedDataParallelTest, DifferentModelsAreAClearError) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    Other net(g.rank() == 0 ? 3 : 5);
    DDPOptions o = options_for(g, false, 25);
    try {
      DistributedDataParallel ddp(net.ptr(), o);
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("expects the same model on every rank: parameter 0 is fc.weight Float "
                            "[5, 4] on rank 1 but fc.weight Float [3, 4] on rank 0"));
    }
  });
}

// A module over two devices is refused at once, naming both (before any collective: no hang).
TEST(DistributedDataParallelTest, AModuleOverSeveralDevicesIsAClearError) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    auto net = std::make_shared<torch::nn::Module>();
    net->register_parameter("weight", torch::zeros({3}));
    net->register_parameter("bias", torch::zeros({3}, torch::Device(torch::kMeta)));
    try {
      DistributedDataParallel ddp(net, options_for(g, false, 25));
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("parameter 'bias' is on meta but 'weight' is on cpu; a "
                            "module spread over several devices is not supported"));
    }
  });
}

}  // namespace
}  // namespace dtrain::ddp_hooks
