// rpc::remote with registered functions, distributed autograd contexts, and
// DistributedOptimizer::step's context checks, on workers that are threads of this process.
#include <atomic>
#include <chrono>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "rpc/dist_autograd.h"
#include "rpc/distributed_optimizer.h"
#include "rpc/functions.h"
#include "rpc/local_optimizers.h"
#include "rpc/remote.h"
#include "rpc/testing/test_workers.h"

namespace dtrain::rpc {
namespace {

using rpc::testing::run_workers;
using rpc::testing::Worker;
using ::testing::HasSubstr;

// Each worker's ParameterOwner, published for the trainer thread to inspect.
struct Owners {
  std::vector<std::atomic<ParameterOwner*>> by_rank;
  explicit Owners(size_t n) : by_rank(n) {}
  void publish(Worker& w) { by_rank[w.rank] = &w.owner; }
  ParameterOwner& wait(int rank) {
    while (by_rank[rank].load() == nullptr)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return *by_rank[rank].load();
  }
};

std::string message(const absl::Status& s) { return std::string(s.message()); }

TEST(DistAutogradTest, SeedExampleAsWritten) {
  // torch.distributed.optim's example: the parameters on worker1 after one SGD step.
  Owners owners(2);
  run_workers({"worker0", "worker1"}, [&](Worker& w) {
    owners.publish(w);
    if (w.rank != 0) return;
    dist_autograd::Context context(w.agent);  // with dist_autograd.context() as context_id:
    absl::StatusOr<RemoteRef> rref1 =
        remote(w.agent, "worker1", "torch.add", {torch::ones({2}), 3});
    absl::StatusOr<RemoteRef> rref2 =
        remote(w.agent, "worker1", "torch.add", {torch::ones({2}), 1});
    ASSERT_TRUE(rref1.ok() && rref2.ok()) << rref1.status() << rref2.status();
    torch::Tensor loss =
        *dist_autograd::to_here(context, *rref1) + *dist_autograd::to_here(context, *rref2);
    ASSERT_TRUE(dist_autograd::backward(context, {loss.sum()}).ok());
    auto dist_optim = DistributedOptimizer::create<torch::optim::SGD>(
        w.agent, torch::optim::SGDOptions(0.05), {*rref1, *rref2});
    ASSERT_TRUE(dist_optim.ok()) << dist_optim.status();
    absl::Status s = (*dist_optim)->step(context.id());
    ASSERT_TRUE(s.ok()) << s;

    ParameterOwner& worker1 = owners.wait(1);
    EXPECT_TRUE(worker1.grad(context.id(), rref1->id)->equal(torch::ones({2})));
    EXPECT_TRUE(worker1.local(rref1->id).allclose(torch::full({2}, 3.95)));  // 4 - 0.05 * 1
    EXPECT_TRUE(worker1.local(rref2->id).allclose(torch::full({2}, 1.95)));  // 2 - 0.05 * 1
    EXPECT_EQ(worker1.local(rref1->id).dtype(), torch::kFloat);
    EXPECT_TRUE(to_here(w.agent, *rref2)->allclose(torch::full({2}, 1.95)));
  });
}

TEST(DistAutogradTest, RemoteRunsRegisteredFunctionsWhereTheValueStays) {
  FunctionRegistry::global().register_function("test.scale", [](const std::vector<c10::IValue>& a) {
    TORCH_CHECK(a.size() == 2 && a[0].isTensor() && a[1].isDouble(),
                "test.scale takes (tensor, double)");
    return a[0].toTensor() * a[1].toDouble();
  });
  Owners owners(2);
  run_workers({"trainer", "ps1"}, [&](Worker& w) {
    owners.publish(w);
    if (w.rank != 0) return;
    ParameterOwner& ps1 = owners.wait(1);
    const torch::Tensor x = torch::arange(6, torch::kDouble).view({2, 3});
    RemoteRef sum = *remote(w.agent, "ps1", "torch.add", {x, x, 0.5});
    EXPECT_TRUE(ps1.local(sum.id).equal(x * 1.5));
    EXPECT_TRUE(to_here(w.agent, sum)->equal(x * 1.5));
    EXPECT_TRUE(to_here(w.agent, *remote(w.agent, "ps1", "torch.sub", {x, 1}))->equal(x - 1));
    EXPECT_TRUE(to_here(w.agent, *remote(w.agent, "ps1", "torch.mul", {x, x}))->equal(x * x));
    EXPECT_TRUE(to_here(w.agent, *remote(w.agent, "ps1", "torch.ones", {2, 3}))
                    ->equal(torch::ones({2, 3})));
    EXPECT_TRUE(to_here(w.agent, *remote(w.agent, "ps1", "torch.zeros", {std::vector<int64_t>{4}}))
                    ->equal(torch::zeros({4})));
    EXPECT_TRUE(
        to_here(w.agent, *remote(w.agent, "ps1", "torch.full", {std::vector<int64_t>{2}, 2.5}))
            ->equal(torch::full({2}, 2.5)));
    EXPECT_TRUE(to_here(w.agent, *remote(w.agent, "ps1", "test.scale", {x, 2.0}))->equal(x * 2));
    // The owner keeps the value: the optimizer updates it in place there.
    auto opt = DistributedOptimizer::create(w.agent, "SGD",
                                            [] {
                                              optim::OptionsDict d = optim::new_options_dict();
                                              d.insert("lr", 1.0);
                                              return d;
                                            }(),
                                            {sum});
    ASSERT_TRUE(opt.ok()) << opt.status();
    GradientContext ctx(w.agent);
    ASSERT_TRUE(ctx.send({sum}, {torch::ones({2, 3}, torch::kDouble)}).ok());
    ASSERT_TRUE((*opt)->step(ctx.id()).ok());
    EXPECT_TRUE(ps1.local(sum.id).equal(x * 1.5 - 1));

    absl::Status unknown = remote(w.agent, "ps1", "torch.nope", {x}).status();
    EXPECT_THAT(message(unknown), HasSubstr("worker 'ps1'"));
    EXPECT_THAT(message(unknown), HasSubstr("no function named 'torch.nope'"));
    EXPECT_THAT(message(unknown), HasSubstr("torch.add"));  // lists what is there
    EXPECT_THAT(
        message(remote(w.agent, "ps1", "torch.add", {x, "three"}).status()),
        HasSubstr(
            "torch.add takes (tensor, tensor or number[, alpha number]), got (Tensor, String)"));
    absl::Status cannot =
        remote(w.agent, "ps1", "torch.add", {x, c10::ivalue::Tuple::create({1.0})}).status();
    EXPECT_EQ(cannot.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(message(cannot), HasSubstr("argument 1 has a type (Tuple) that cannot travel"));
  });
}

TEST(DistAutogradTest, BackwardSendsOneMessagePerOwnerAsSoonAsItsGradientsAreReady) {
  Owners owners(3);
  run_workers({"trainer", "ps1", "ps2"}, [&](Worker& w) {
    owners.publish(w);
    if (w.rank != 0) return;
    ParameterOwner& ps1 = owners.wait(1);
    ParameterOwner& ps2 = owners.wait(2);
    RemoteRef a = *remote(w.agent, "ps1", "torch.full", {std::vector<int64_t>{3}, 0.5});
    RemoteRef unused = *remote(w.agent, "ps1", "torch.ones", {3});
    RemoteRef b = *remote(w.agent, "ps2", "torch.ones", {2, 2});
    dist_autograd::Context ctx(w.agent);
    torch::Tensor a1 = *dist_autograd::to_here(ctx, a), a2 = *dist_autograd::to_here(ctx, a);
    torch::Tensor b1 = *dist_autograd::to_here(ctx, b);
    ASSERT_TRUE(dist_autograd::to_here(ctx, unused).ok());
    EXPECT_TRUE(a1.requires_grad() && a1.is_leaf());
    EXPECT_EQ(ctx.num_remote_leaves(), 4u);
    torch::Tensor t = a1 * 2 + a2;  // ps1's part: autograd reaches it after b's leaf
    torch::Tensor u = b1 * 3;
    // Autograd runs t's node only after b's leaf (AccumulateGrad runs as soon as it is ready):
    // by then ps2 must get its gradient although a's are still to come.
    std::atomic<bool> ps2_had_it{false};
    t.register_hook([&](const torch::Tensor&) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!ps2.grad(ctx.id(), b.id).has_value() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      ps2_had_it = ps2.grad(ctx.id(), b.id).has_value();
    });
    absl::Status s = dist_autograd::backward(ctx, {t.sum() + u.sum()});
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(ps2_had_it) << "ps2's gradient was not sent before autograd finished";
    EXPECT_EQ(ps1.num_gradient_messages(), 1);  // a1 and a2 together: one message
    EXPECT_EQ(ps2.num_gradient_messages(), 1);
    EXPECT_TRUE(
        ps1.grad(ctx.id(), a.id)->equal(torch::full({3}, 3.0)));  // 2 + 1, accumulated on ps1
    EXPECT_TRUE(ps2.grad(ctx.id(), b.id)->equal(torch::full({2, 2}, 3.0)));
    EXPECT_FALSE(ps1.grad(ctx.id(), unused.id).has_value());  // not reached: not sent

    // A second backward in the context adds; only owners it reaches hear from it.
    ASSERT_TRUE(dist_autograd::backward(ctx, {(a1 * 4).sum()}).ok());
    EXPECT_EQ(ps1.num_gradient_messages(), 2);
    EXPECT_EQ(ps2.num_gradient_messages(), 1);
    EXPECT_TRUE(ps1.grad(ctx.id(), a.id)->equal(torch::full({3}, 7.0)));

    // Misuse is a TORCH_CHECK naming the root.
    try {
      (void)dist_autograd::backward(ctx, {a1 * 2});
      ADD_FAILURE() << "a non-scalar root was accepted";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("root 0 must be a scalar that requires grad"));
    }
    ASSERT_TRUE(ctx.release().ok());
    EXPECT_EQ(ps1.num_contexts(), 0u);
    EXPECT_EQ(dist_autograd::backward(ctx, {a1.sum()}).code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(dist_autograd::to_here(ctx, a).status().code(),
              absl::StatusCode::kFailedPrecondition);
  });
}

TEST(DistAutogradTest, StepOnAnUnknownOrReleasedContextIsAnErrorNamingIt) {
  Owners owners(2);
  run_workers({"trainer", "ps1"}, [&](Worker& w) {
    owners.publish(w);
    if (w.rank != 0) return;
    ParameterOwner& ps1 = owners.wait(1);
    RemoteRef p = *remote(w.agent, "ps1", "torch.ones", {3});
    auto opt = DistributedOptimizer::create<torch::optim::SGD>(w.agent,
                                                               torch::optim::SGDOptions(0.5), {p});
    ASSERT_TRUE(opt.ok()) << opt.status();

    absl::Status never = (*opt)->step(123456789);
    EXPECT_EQ(never.code(), absl::StatusCode::kNotFound) << never;
    EXPECT_THAT(message(never), HasSubstr("autograd context 123456789 is unknown"));

    int64_t id = 0;
    {
      dist_autograd::Context ctx(w.agent);
      id = ctx.id();
      ASSERT_TRUE(dist_autograd::backward(ctx, {dist_autograd::to_here(ctx, p)->sum()}).ok());
      ASSERT_TRUE(ctx.release().ok());
      absl::Status released = (*opt)->step(id);
      EXPECT_EQ(released.code(), absl::StatusCode::kNotFound) << released;
      EXPECT_THAT(message(released),
                  HasSubstr(absl::StrCat("autograd context ", id, " was released")));
    }
    GradientContext gone(w.agent);
    (void)gone.release();
    EXPECT_EQ(gone.send({p}, {torch::ones({3})}).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(ps1.local(p.id).equal(torch::ones({3})));  // nothing stepped

    // A live context whose gradients are elsewhere is fine, as before: nothing moves here.
    GradientContext live(w.agent);
    EXPECT_TRUE((*opt)->step(live.id()).ok());
    ASSERT_TRUE(live.send({p}, {torch::ones({3})}).ok());
    EXPECT_TRUE((*opt)->step(live.id()).ok());
    EXPECT_TRUE(ps1.local(p.id).equal(torch::full({3}, 0.5)));
  });
}

// A user's LibTorch optimizer with no functional form: p -= lr * sign(grad).
struct SignSGDOptions : torch::optim::OptimizerCloneableOptions<SignSGDOptions> {
  explicit SignSGDOptions(double lr) : lr_(lr) {}
  TORCH_ARG(double, lr);
};

class SignSGD : public torch::optim::Optimizer {
 public:
  SignSGD(std::vector<at::Tensor> params, SignSGDOptions o)
      : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                                std::make_unique<SignSGDOptions>(o)) {}
  at::Tensor step(LossClosure = nullptr) override {
    torch::NoGradGuard no_grad;
    const double lr = static_cast<SignSGDOptions&>(param_groups()[0].options()).lr();
    for (auto& p : param_groups()[0].params()) {
      if (p.grad().defined()) p.sub_(p.grad().sign() * lr);
    }
    return {};
  }
};

struct Unregistered : SignSGD {
  using SignSGD::SignSGD;
};

TEST(DistAutogradTest, AnOptimizerWithNoFunctionalFormRunsOnTheOwner) {
  LocalOptimizerRegistry::global().register_optimizer<SignSGD, SignSGDOptions>(
      "SignSGD",
      [](const SignSGDOptions& o) {
        optim::OptionsDict d = optim::new_options_dict();
        d.insert("lr", o.lr());
        return d;
      },
      [](const optim::OptionsDict& d) { return SignSGDOptions(d.at("lr").toDouble()); });
  Owners owners(2);
  run_workers({"trainer", "ps1"}, [&](Worker& w) {
    owners.publish(w);
    if (w.rank != 0) return;
    ParameterOwner& ps1 = owners.wait(1);
    RemoteRef p = *remote(w.agent, "ps1", "torch.ones", {3});
    auto opt = DistributedOptimizer::create<SignSGD>(w.agent, SignSGDOptions(0.1), {p});
    ASSERT_TRUE(opt.ok()) << opt.status();
    for (int step = 0; step < 2; ++step) {
      dist_autograd::Context ctx(w.agent);
      torch::Tensor x = *dist_autograd::to_here(ctx, p);
      ASSERT_TRUE(
          dist_autograd::backward(ctx, {(x * torch::tensor({2.0f, -3.0f, 0.0f})).sum()}).ok());
      absl::Status s = (*opt)->step(ctx.id());
      ASSERT_TRUE(s.ok()) << s;
    }
    EXPECT_TRUE(
        ps1.local(p.id).allclose(torch::tensor({0.8f, 1.2f, 1.0f})));  // 1 - 2 * 0.1 * sign(g)
    EXPECT_FALSE(ps1.local(p.id).grad().defined());  // .grad is the context's only during the step

    auto unregistered =
        DistributedOptimizer::create<Unregistered>(w.agent, SignSGDOptions(0.1), {p});
    EXPECT_EQ(unregistered.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(message(unregistered.status()),
                HasSubstr("not registered with rpc::LocalOptimizerRegistry"));
  });
}

}  // namespace
}  // namespace dtrain::rpc
