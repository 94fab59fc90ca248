#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/testing/test_harness.h"
#include "optim/functional/optimizers.h"
#include "optim/functional/registry.h"
#include "optim/functional/testing/qhm.h"
#include "rpc/agent.h"
#include "rpc/codec.h"
#include "rpc/distributed_optimizer.h"
#include "rpc/remote.h"
#include "rpc/testing/test_workers.h"

namespace dtrain::rpc {
namespace {

using ::testing::HasSubstr;

using rpc::testing::run_workers;
using rpc::testing::Worker;

TEST(RpcTest, StrayAddsToTheStoreCannotWedgeShutdown) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  // Another process on the store bumps what a shared arrival counter would be.
  store->add("dtrain/rpc-shutdown/arrived", 1);
  store->add("dtrain/rpc-shutdown/arrived", 5);
  const auto start = std::chrono::steady_clock::now();
  run_workers(
      {"w0", "w1", "w2"}, [](Worker&) {}, std::chrono::seconds(5), nullptr, store);
  // 10x the 5 s timeout: a wedged shutdown fails, a loaded machine does not.
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 50);
}

TEST(RpcTest, CallsErrorsAndMalformedMessages) {
  run_workers(
      {"w0", "w1"},
      [](Worker& w) {
        if (w.rank != 0) return;
        absl::StatusOr<Response> r =
            w.agent.rpc_sync("w1", "echo", Writer().str("hi").i64(3), {torch::ones({2})});
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_EQ(r->body.str(), "hi!");
        ASSERT_EQ(r->tensors.size(), 1u);
        EXPECT_TRUE(r->tensors[0].equal(torch::full({2}, 3.0)));

        absl::StatusOr<Response> who = w.agent.rpc_sync("w1", "whoami", Writer());
        ASSERT_TRUE(who.ok()) << who.status();
        EXPECT_EQ(who->body.str(), "w0");  // Request::caller

        absl::StatusOr<Response> boom = w.agent.rpc_sync("w1", "boom", Writer());
        EXPECT_EQ(boom.status().code(), absl::StatusCode::kInternal);
        EXPECT_THAT(std::string(boom.status().message()),
                    HasSubstr("worker 'w1', handler 'boom': kaput"));
        EXPECT_THAT(std::string(w.agent.rpc_sync("w1", "nope", Writer()).status().message()),
                    HasSubstr("no handler named 'nope' is registered"));
        EXPECT_THAT(std::string(w.agent.rpc_sync("w9", "echo", Writer()).status().message()),
                    HasSubstr("no worker named 'w9'"));
        // Tensors off the CPU are refused before the transport (a GPU's would be CUDA; meta here).
        EXPECT_THAT(
            std::string(
                w.agent
                    .rpc_sync("w1", "echo", Writer().str("x").i64(1),
                              {torch::ones({2}), torch::ones({2}, torch::Device(torch::kMeta))})
                    .status()
                    .message()),
            HasSubstr(
                "tensor 1 of this RPC message is on meta: dtrain's RPC sends CPU tensors only"));
        // A body of the wrong types reaches the handler's reader, which refuses it.
        EXPECT_THAT(std::string(w.agent.rpc_sync("w1", "echo", Writer().i64(1)).status().message()),
                    HasSubstr("expected a string (tag 4) but found tag 1"));

        // Raw, malformed payloads: error replies, and the worker keeps serving.
        std::vector<char> good = encode_envelope("echo", Writer().str("x").i64(1), 0);
        std::vector<char> truncated(good.begin(), good.end() - 3);
        EXPECT_THAT(std::string(w.agent.send_raw("w1", truncated).get().status().message()),
                    HasSubstr("body declares"));
        std::vector<char> old_version = good;
        old_version[4] = 7;
        EXPECT_THAT(std::string(w.agent.send_raw("w1", old_version).get().status().message()),
                    HasSubstr("unsupported message version 7"));
        std::vector<char> huge = encode_envelope("echo", Writer().str("x"), 0);
        const uint32_t lie = 0x7FFFFFFF;
        std::memcpy(huge.data() + huge.size() - 5, &lie,
                    sizeof(lie));  // the string's declared length
        EXPECT_THAT(std::string(w.agent.send_raw("w1", huge).get().status().message()),
                    HasSubstr("declares 2147483647 elements"));
        EXPECT_THAT(std::string(w.agent.send_raw("w1", {'a', 'b'}).get().status().message()),
                    HasSubstr("truncated message"));
        EXPECT_THAT(
            std::string(w.agent.send_raw("w1", good, {torch::ones({1})}).get().status().message()),
            HasSubstr("declares 0 tensors but carries 1"));
        absl::StatusOr<Response> again =
            w.agent.rpc_sync("w1", "echo", Writer().str("still").i64(1));
        ASSERT_TRUE(again.ok()) << again.status();
        EXPECT_EQ(again->body.str(), "still!");
      },
      std::chrono::seconds(30),
      [](int rank, Handlers& h) {
        if (rank != 1) return;
        h.add("echo", [](Request& r) {
          Reply reply;
          reply.body.str(r.body.str() + "!");
          const int64_t k = r.body.i64();
          r.body.expect_done();
          for (auto& t : r.tensors) reply.tensors.push_back(t * k);
          return reply;
        });
        h.add("boom", [](Request&) -> Reply { throw std::runtime_error("kaput"); });
        h.add("whoami", [](Request& r) { return Reply{Writer().str(r.caller), {}}; });
      });
}

// The model of PyTorch's dist_optimizer_test: two owners, a trainer that computes gradients
// locally on fetched parameters.
struct Model {
  std::vector<torch::Tensor> init = {torch::sin(torch::arange(12, torch::kDouble).view({4, 3})),
                                     torch::cos(torch::arange(6, torch::kDouble).view({3, 2})),
                                     torch::arange(2, torch::kDouble) * 0.1};
  std::vector<std::string> owners = {"ps1", "ps2", "ps2"};
  static std::vector<torch::Tensor> grads(const std::vector<torch::Tensor>& params, int step) {
    std::vector<torch::Tensor> p;
    for (const auto& t : params) p.push_back(t.detach().clone().requires_grad_(true));
    const torch::Tensor x =
        torch::cos(torch::arange(8, torch::kDouble).view({2, 4}) + step).to(p[0].scalar_type());
    (torch::tanh(x.matmul(p[0])).matmul(p[1]) + p[2]).pow(2).sum().backward();
    std::vector<torch::Tensor> g;
    for (auto& t : p) g.push_back(t.grad());
    return g;
  }
};

void check_parity(const std::string& name, optim::OptionsDict options,
                  torch::Dtype dtype = torch::kDouble) {
  constexpr int kSteps = 4;
  Model model;
  for (auto& t : model.init) t = t.to(dtype);
  // Local reference: the same functional optimizer, in this process.
  std::vector<torch::Tensor> local;
  for (const auto& t : model.init) local.push_back(t.clone());
  auto reference = optim::FunctionalRegistry::global().create(name, local, options);
  for (int s = 0; s < kSteps; ++s) reference->step(Model::grads(local, s));

  run_workers({"trainer", "ps1", "ps2"}, [&](Worker& w) {
    if (w.rank != 0) return;
    std::vector<RemoteRef> refs;
    for (size_t i = 0; i < model.init.size(); ++i) {
      auto ref = remote_parameter(w.agent, model.owners[i], model.init[i]);
      ASSERT_TRUE(ref.ok()) << ref.status();
      refs.push_back(*ref);
    }
    auto opt = DistributedOptimizer::create(w.agent, name, options, refs);
    ASSERT_TRUE(opt.ok()) << opt.status();
    for (int s = 0; s < kSteps; ++s) {
      std::vector<torch::Tensor> params;
      for (const auto& r : refs) params.push_back(*to_here(w.agent, r));
      GradientContext ctx(w.agent);
      ASSERT_TRUE(ctx.send(refs, Model::grads(params, s)).ok());
      absl::Status st = (*opt)->step(ctx.id());
      ASSERT_TRUE(st.ok()) << st;
    }
    for (size_t i = 0; i < refs.size(); ++i) {
      torch::Tensor remote = *to_here(w.agent, refs[i]);
      EXPECT_TRUE(remote.allclose(local[i], 1e-12, 1e-14)) << name << " param " << i << "\n"
                                                           << remote << "\n"
                                                           << local[i];
      EXPECT_FALSE(remote.equal(model.init[i])) << name << " param " << i << " never moved";
    }
  });
}

optim::OptionsDict dict(std::initializer_list<std::pair<const char*, c10::IValue>> items) {
  optim::OptionsDict d = optim::new_options_dict();
  for (const auto& [k, v] : items) d.insert(k, v);
  return d;
}

TEST(RpcTest, DistributedOptimizerMatchesTheLocalOptimizer) {
  check_parity("Adagrad", dict({{"lr", 0.05}}));
  check_parity("Adam", dict({{"lr", 0.05}, {"amsgrad", true}}));
  check_parity(
      "AdamW",
      dict({{"lr", 0.05}, {"amsgrad", true}, {"betas", c10::ivalue::Tuple::create({0.8, 0.99})}}));
  check_parity("SGD", dict({{"lr", 0.05}}));
  check_parity("SGD",
               dict({{"lr", 0.05}, {"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 0.01}}));
  check_parity("Adadelta", dict({{"lr", 0.5}}));
  check_parity("RMSprop", dict({{"lr", 0.01}}));
  check_parity("Adamax", dict({{"lr", 0.05}}));
  check_parity("Rprop", dict({{"lr", 0.05}}));
  // Optimizer state in bfloat16 (to nearest) and 8 bits on the owners (state_precision.h).
  // (Stochastic rounding is keyed by the parameter's index in its owner's optimizer, so it matches
  // one local optimizer per owner, not this single reference.)
  check_parity("AdamW", dict({{"lr", 0.05},
                              {"state_dtype", std::string("bfloat16")},
                              {"state_stochastic_rounding", false}}));
  check_parity("Adam", dict({{"lr", 0.05}, {"state_dtype", std::string("8bit")}}));
  // bfloat16 parameters whose remainders (the float32 masters' low bits) stay on the owners.
  check_parity(
      "AdamW",
      dict({{"lr", 0.05}, {"param_remainders", true}, {"state_dtype", std::string("8bit")}}),
      torch::kBFloat16);
  // A user optimizer (QHM) registered by name and built on the owners through the registry.
  optim::testing::register_qhm();
  check_parity("QHM", dict({{"lr", 0.05}, {"momentum", 0.9}, {"nu", 0.7}, {"weight_decay", 0.01}}));
}

TEST(RpcTest, ParametersWithoutGradientsAreUntouchedAndContextsAreReleased) {
  run_workers({"trainer", "ps1", "ps2"}, [](Worker& w) {
    if (w.rank == 0) {
      Model model;
      std::vector<RemoteRef> refs;
      for (size_t i = 0; i < model.init.size(); ++i)
        refs.push_back(*remote_parameter(w.agent, model.owners[i], model.init[i]));
      // From the LibTorch optimizer type, through the registry's twin.
      auto opt = DistributedOptimizer::create<torch::optim::Adam>(
          w.agent, torch::optim::AdamOptions(0.1), refs);
      ASSERT_TRUE(opt.ok()) << opt.status();
      {
        GradientContext ctx(w.agent);
        ASSERT_TRUE(ctx.send({refs[0]}, {torch::ones({4, 3}, torch::kDouble)}).ok());
        ASSERT_TRUE((*opt)->step(ctx.id()).ok());
        EXPECT_FALSE(to_here(w.agent, refs[0])->equal(model.init[0]));
        EXPECT_TRUE(to_here(w.agent, refs[1])->equal(model.init[1]));
        EXPECT_TRUE(to_here(w.agent, refs[2])->equal(model.init[2]));
        // Gradients accumulate within a context: a second push adds.
        ASSERT_TRUE(ctx.send({refs[1], refs[1]}, {torch::ones({3, 2}, torch::kDouble),
                                                  torch::ones({3, 2}, torch::kDouble)})
                        .ok());
        ASSERT_TRUE(ctx.release().ok());
      }
      // A shape that does not match the owner's parameter is the owner's error, named.
      GradientContext bad(w.agent);
      absl::Status s = bad.send({refs[2]}, {torch::ones({5}, torch::kDouble)});
      EXPECT_THAT(std::string(s.message()), HasSubstr("worker 'ps2'"));
      EXPECT_THAT(std::string(s.message()), HasSubstr("has shape [5]"));
    }
  });
}

class FailingOptimizer : public optim::FunctionalSGD {
 public:
  FailingOptimizer(std::vector<at::Tensor> params, const optim::OptionsDict& o)
      : optim::FunctionalSGD(std::move(params), optim::SGDOptions(0.1)) {
    TORCH_CHECK(!o.contains("refuse"), "Failing refuses to be built");
  }
  std::string name() const override { return "Failing"; }

 protected:
  void update(size_t, const at::Tensor&) override { TORCH_CHECK(false, "Failing.step exploded"); }
  void update_all(const std::vector<at::Tensor>&) override {
    TORCH_CHECK(false, "Failing.step exploded");
  }
};

TEST(RpcTest, ErrorsFromConstructionAndStepReachTheCaller) {
  optim::FunctionalRegistry::global().register_optimizer(
      "Failing", [](std::vector<at::Tensor> p, const optim::OptionsDict& o) {
        return std::unique_ptr<optim::FunctionalOptimizer>(
            std::make_unique<FailingOptimizer>(std::move(p), o));
      });
  run_workers({"trainer", "ps1", "ps2"}, [](Worker& w) {
    if (w.rank != 0) return;
    Model model;
    std::vector<RemoteRef> refs;
    for (size_t i = 0; i < model.init.size(); ++i)
      refs.push_back(*remote_parameter(w.agent, model.owners[i], model.init[i]));
    auto unknown = DistributedOptimizer::create(w.agent, "NoSuchOptimizer", dict({}), refs);
    EXPECT_THAT(std::string(unknown.status().message()),
                HasSubstr("creating NoSuchOptimizer on 'ps1' failed"));
    EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("NoSuchOptimizer"));
    auto negative = DistributedOptimizer::create(w.agent, "Adam", dict({{"lr", -1.0}}), refs);
    EXPECT_THAT(std::string(negative.status().message()), HasSubstr("Invalid learning rate: -1"));
    auto refused = DistributedOptimizer::create(w.agent, "Failing", dict({{"refuse", true}}), refs);
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("Failing refuses to be built"));
    auto failing = DistributedOptimizer::create(w.agent, "Failing", dict({}), refs);
    ASSERT_TRUE(failing.ok()) << failing.status();
    GradientContext ctx(w.agent);
    ASSERT_TRUE(ctx.send(refs, Model::grads(model.init, 0)).ok());
    absl::Status s = (*failing)->step(ctx.id());
    EXPECT_THAT(std::string(s.message()), HasSubstr("DistributedOptimizer::step on 'ps1' failed"));
    EXPECT_THAT(std::string(s.message()), HasSubstr("Failing.step exploded"));
  });
}

// A user optimizer registered by name and used remotely: SGD whose step is scaled by "scale".
class ScaledSGD : public optim::FunctionalSGD {
 public:
  ScaledSGD(std::vector<at::Tensor> params, const optim::OptionsDict& o)
      : optim::FunctionalSGD(std::move(params),
                             optim::SGDOptions(o.at("lr").toDouble() * o.at("scale").toDouble())) {}
  std::string name() const override { return "ScaledSGD"; }
};

TEST(RpcTest, UserRegisteredOptimizerWorksRemotely) {
  optim::FunctionalRegistry::global().register_optimizer(
      "ScaledSGD", [](std::vector<at::Tensor> p, const optim::OptionsDict& o) {
        return std::unique_ptr<optim::FunctionalOptimizer>(
            std::make_unique<ScaledSGD>(std::move(p), o));
      });
  run_workers({"trainer", "ps1"}, [](Worker& w) {
    if (w.rank != 0) return;
    RemoteRef p = *remote_parameter(w.agent, "ps1", torch::ones({3}));
    auto opt = DistributedOptimizer::create(w.agent, "ScaledSGD",
                                            dict({{"lr", 0.5}, {"scale", 4.0}}), {p});
    ASSERT_TRUE(opt.ok()) << opt.status();
    GradientContext ctx(w.agent);
    ASSERT_TRUE(ctx.send({p}, {torch::full({3}, 0.25)}).ok());
    ASSERT_TRUE((*opt)->step(ctx.id()).ok());
    EXPECT_TRUE(to_here(w.agent, p)->allclose(torch::full({3}, 0.5)));  // 1 - 0.5 * 4 * 0.25
  });
}

// A rendezvous store that stops answering once the job runs: a stray client wedging c10d's store
// server, or rank 0's host gone ("Socket Timeout" in issue 29's campaign).
class WedgeableStore : public c10d::HashStore {
 public:
  std::atomic<bool> wedged{false};
  void set(const std::string& k, const std::vector<uint8_t>& v) override {
    check_wedged();
    HashStore::set(k, v);
  }
  std::vector<uint8_t> get(const std::string& k) override {
    check_wedged();
    return HashStore::get(k);
  }
  int64_t add(const std::string& k, int64_t v) override {
    check_wedged();
    return HashStore::add(k, v);
  }
  bool check(const std::vector<std::string>& keys) override {
    check_wedged();
    return HashStore::check(keys);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    check_wedged();
    HashStore::wait(keys, t);
  }

 private:
  void check_wedged() { TORCH_CHECK(!wedged, "Socket Timeout (the store is wedged)"); }
};

// shutdown()'s barrier runs over RPC: with the store wedged after startup, calls still work and
// every worker shuts down cleanly (run_workers checks shutdown's Status), promptly.
TEST(RpcTest, ShutdownDoesNotNeedTheRendezvousStore) {
  auto store = c10::make_intrusive<WedgeableStore>();
  std::atomic<int> running{0};
  const auto start = std::chrono::steady_clock::now();
  run_workers(
      {"w0", "w1", "w2"},
      [&](Worker& w) {
        ++running;
        while (running.load() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        store->wedged = true;
        const std::string next = "w" + std::to_string((w.rank + 1) % 3);
        absl::StatusOr<Response> r =
            w.agent.rpc_sync(next, "dtrain.test.nothing_registered", Writer().i64(1));
        EXPECT_FALSE(r.ok());  // an error reply: the peer is reachable without the store
        EXPECT_THAT(std::string(r.status().message()), HasSubstr("dtrain.test.nothing_registered"));
      },
      std::chrono::seconds(10), nullptr, store);
  // 10x the 10 s timeout: a wedged shutdown fails, a loaded machine does not.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(100));
}

TEST(RpcTest, ConcurrentClientsGiveTheResultOfSomeSerialOrder) {
  // SGD with weight decay: the update depends on the parameter, so the two orders differ and a
  // torn (interleaved) update would match neither.
  const double lr = 0.1, wd = 0.5;
  const torch::Tensor p0 = torch::linspace(-1, 1, 1 << 16, torch::kDouble);
  const torch::Tensor ga = torch::full_like(p0, 1.0), gb = torch::full_like(p0, -3.0);
  auto sgd = [&](const torch::Tensor& p, const torch::Tensor& g) { return p - lr * (g + wd * p); };
  const torch::Tensor ab = sgd(sgd(p0, ga), gb), ba = sgd(sgd(p0, gb), ga);
  ASSERT_FALSE(ab.allclose(ba));
  for (int round = 0; round < 3; ++round) {
    std::atomic<int> ready{0};
    std::vector<RemoteRef> shared(1);
    std::atomic<bool> created{false};
    run_workers({"ps", "t0", "t1"}, [&](Worker& w) {
      if (w.rank == 0) {
        shared[0] = w.owner.own("ps", p0.clone());
        created = true;
        while (ready.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        EXPECT_TRUE(w.owner.local(shared[0].id).allclose(ab, 1e-12) ||
                    w.owner.local(shared[0].id).allclose(ba, 1e-12))
            << "round " << round;
        return;
      }
      while (!created) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      auto opt = DistributedOptimizer::create(w.agent, "SGD",
                                              dict({{"lr", lr}, {"weight_decay", wd}}), shared);
      ASSERT_TRUE(opt.ok()) << opt.status();
      GradientContext ctx(w.agent);
      ASSERT_TRUE(ctx.send(shared, {w.rank == 1 ? ga : gb}).ok());
      ++ready;
      while (ready.load() < 2) {
      }
      ASSERT_TRUE((*opt)->step(ctx.id()).ok());
    });
  }
}

TEST(RpcTest, AnOwnerThatDoesNotAnswerFailsTheStepWithinTheTimeout) {
  // The owner's update is held until the trainer's step() has returned: the step fails by its
  // timeout while the owner still works (order, not a time bound a loaded machine could miss).
  static std::atomic<bool> release{false};
  release = false;
  optim::FunctionalRegistry::global().register_optimizer(
      "Sleepy", [](std::vector<at::Tensor> p, const optim::OptionsDict&) {
        struct Sleepy : optim::FunctionalSGD {
          explicit Sleepy(std::vector<at::Tensor> p)
              : optim::FunctionalSGD(std::move(p), optim::SGDOptions(0.1)) {}
          std::string name() const override { return "Sleepy"; }
          void update_all(const std::vector<at::Tensor>&) override {
            while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
        };
        return std::unique_ptr<optim::FunctionalOptimizer>(std::make_unique<Sleepy>(std::move(p)));
      });
  run_workers(
      {"trainer", "ps1"},
      [](Worker& w) {
        if (w.rank != 0) return;
        RemoteRef p = *remote_parameter(w.agent, "ps1", torch::ones({3}));
        auto opt = DistributedOptimizer::create(w.agent, "Sleepy", dict({}), {p});
        ASSERT_TRUE(opt.ok()) << opt.status();
        GradientContext ctx(w.agent);
        ASSERT_TRUE(ctx.send({p}, {torch::ones({3})}).ok());
        absl::Status s = (*opt)->step(ctx.id());
        release = true;  // the owner finishes its update only now
        EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
        EXPECT_THAT(std::string(s.message()), HasSubstr("'ps1'"));
        std::this_thread::sleep_for(
            std::chrono::seconds(1));  // let the owner finish before shutdown
      },
      std::chrono::seconds(1));
}

TEST(RpcTest, ADeadOwnerFailsTheStepWithinTheTimeout) {
  // Real processes: the owner exits abruptly (no shutdown) once the optimizer exists.
  comm::testing::run_ranks_as_processes(2, [](comm::Group& world) {
    auto handlers = std::make_shared<Handlers>();
    ParameterOwner owner(handlers);
    RemoteRef p{"ps1", 0};
    if (world.rank() == 1) p = owner.own("ps1", torch::ones({3}));
    AgentOptions o;
    o.name = world.rank() == 0 ? "trainer" : "ps1";
    o.rank = world.rank();
    o.world_size = 2;
    o.store = world.store();
    o.handlers = handlers;
    o.timeout = std::chrono::seconds(5);
    auto agent = Agent::create(o);
    ASSERT_TRUE(agent.ok()) << agent.status();
    if (world.rank() == 1) {
      world.store()->wait({"optimizer-ready"});
      std::_Exit(0);  // dies with the optimizer and its parameters
    }
    p.id = 1;
    auto opt = DistributedOptimizer::create(**agent, "SGD", dict({{"lr", 0.1}}), {p});
    ASSERT_TRUE(opt.ok()) << opt.status();
    GradientContext ctx(**agent);
    ASSERT_TRUE(ctx.send({p}, {torch::ones({3})}).ok());
    world.store()->set("optimizer-ready", std::vector<uint8_t>{1});
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = (*opt)->step(ctx.id());
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.message()), HasSubstr("'ps1'"));
    EXPECT_LT(seconds, 50.0);  // 10x the 5 s timeout: a bound a loaded machine cannot miss
    std::_Exit(::testing::Test::HasFailure() ? 1 : 0);  // no collective shutdown: the peer is gone
  });
}

}  // namespace
}  // namespace dtrain::rpc
