// Streaming DiLoCo's overlap (DiLoCoOptions::fragment_sync_delay, fragment_update_alpha) against
// its definitions: delay 0 is the blocking sync written out (DiLoCo before the options) bit for
// bit, plain and compressed; delay > 0 and alpha follow PyTorch simulating torchft's workers
// (testdata/make_diloco_streaming_reference.py, run at test time with the installed PyTorch); the
// all-reduce really runs behind the inner steps (one rank runs ahead of the other); a state dict
// taken while it is in flight resumes bit for bit; bad options and pending averages are refused.
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <future>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include "checkpoint/state_file.h"
#include "comm/testing/test_harness.h"
#include "optim/diloco.h"
#include "optim/diloco_compression.h"
#include "optim/functional/registry.h"
#include "optim/testing/diloco_testing.h"
#include "testing/pytorch_python.h"
#include "testing/test_util.h"

namespace dtrain::optim {
namespace {

using comm::testing::run_ranks_as_threads;
using diloco_testing::fresh;
using diloco_testing::max_diff;
using diloco_testing::tensors;
using diloco_testing::with_entry;
using test_util::expect_error;

std::vector<at::Tensor> init_params() {
  return {at::cos(at::arange(12, at::kFloat)).reshape({3, 4}), at::sin(at::arange(5, at::kFloat)),
          at::full({4}, 0.3)};
}

void set_grads(std::vector<at::Tensor>& p, int rank, int64_t step) {
  for (size_t i = 0; i < p.size(); ++i) {
    p[i].mutable_grad() =
        (p[i].detach() - (rank + 1.0) * 0.3) + 0.1 * std::sin(step * 0.7 + static_cast<double>(i));
  }
}

DiLoCoOptions streaming(const comm::Group& g, int64_t sync_every, int64_t fragments, int64_t delay,
                        double alpha = 0.0, const std::string& compression = "none") {
  DiLoCoOptions o;
  o.group = g;
  o.sync_every = sync_every;
  o.fragments = fragments;
  o.fragment_sync_delay = delay;
  o.fragment_update_alpha = alpha;
  o.outer_compression = compression;
  return o;
}

std::unique_ptr<torch::optim::SGD> inner_sgd(const std::vector<at::Tensor>& p, double lr = 0.05) {
  return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(lr).momentum(0.5));
}

// --- 1. Delay 0 is the blocking sync, bit for bit ------------------------------------------------

// DiLoCo's step before fragment_sync_delay existed, written out: after every sync_every /
// fragments inner steps, the round's fragment's pseudo-gradients (global - local, flat) are
// divided by the group's size and all-reduced, waited at once (or compressed_average), the outer
// optimizer steps the global copies and they are copied into the local parameters.
struct BlockingReference {
  BlockingReference(std::vector<at::Tensor> params, const DiLoCoOptions& o,
                    std::vector<std::vector<int64_t>> frags)
      : p(std::move(params)), inner(inner_sgd(p)), options(o), fragments(std::move(frags)) {
    for (const at::Tensor& t : p) global.push_back(t.detach().clone());
    outer = FunctionalRegistry::global().create("SGD", global, default_outer_options());
  }

  void step() {
    inner->step();
    if (++local_step < options.sync_every / options.fragments) return;
    c10::NoGradGuard no_grad;
    const std::vector<int64_t>& frag = fragments[outer_step++ % fragments.size()];
    local_step = 0;
    std::vector<at::Tensor> parts;
    for (int64_t i : frag) parts.push_back((global[i] - p[i].detach()).reshape(-1));
    at::Tensor flat = at::cat(parts);
    if (options.outer_compression == "none") {
      flat.div_(options.group.size());
      std::vector<at::Tensor> bufs = {flat};
      options.group->allreduce(bufs)->wait();
    } else {
      flat = compressed_average(options.group, flat, options.outer_compression);
    }
    std::vector<at::Tensor> grads(global.size());
    int64_t offset = 0;
    for (int64_t i : frag) {
      grads[i] = flat.narrow(0, offset, global[i].numel()).view(global[i].sizes());
      offset += global[i].numel();
    }
    outer->step(grads);
    for (int64_t i : frag) p[i].detach().copy_(global[i]);
  }

  std::vector<at::Tensor> p;
  std::unique_ptr<torch::optim::SGD> inner;
  DiLoCoOptions options;
  std::vector<std::vector<int64_t>> fragments;
  std::vector<at::Tensor> global;
  std::unique_ptr<FunctionalOptimizer> outer;
  int64_t local_step = 0;
  int64_t outer_step = 0;
};

TEST(DiLoCoStreamingTest, DelayZeroIsTheBlockingSyncBitForBit) {
  for (const std::string compression : {"none", "4bit"}) {
    for (int64_t fragments : {1, 2}) {
      for (int world : {1, 2, 3}) {
        run_ranks_as_threads(world, [&](comm::Group& g) {
          const DiLoCoOptions o = streaming(g, 4, fragments, /*delay=*/0, 0.0, compression);
          DiLoCoOptions defaults = o;  // the options left at their defaults
          defaults.fragment_sync_delay = DiLoCoOptions().fragment_sync_delay;
          defaults.fragment_update_alpha = DiLoCoOptions().fragment_update_alpha;
          std::vector<at::Tensor> a = fresh(init_params()), b = fresh(init_params());
          DiLoCo explicit_zero(inner_sgd(a), o), by_default(inner_sgd(b), defaults);
          std::vector<std::vector<int64_t>> frags;
          for (int64_t f = 0; f < fragments; ++f) frags.push_back(by_default.fragment_params(f));
          BlockingReference ref(fresh(init_params()), o, frags);
          for (int64_t step = 0; step < 15; ++step) {
            set_grads(a, g.rank(), step);
            set_grads(b, g.rank(), step);
            set_grads(ref.p, g.rank(), step);
            explicit_zero.step();
            by_default.step();
            ref.step();
            for (size_t i = 0; i < a.size(); ++i) {
              ASSERT_TRUE(a[i].detach().equal(ref.p[i].detach()))
                  << compression << " world " << world << " fragments " << fragments << " step "
                  << step << " param " << i << ": " << max_diff(a[i], ref.p[i]);
              ASSERT_TRUE(b[i].detach().equal(ref.p[i].detach())) << step;
              ASSERT_TRUE(explicit_zero.global_params()[i].equal(ref.global[i])) << step;
            }
          }
          EXPECT_EQ(by_default.outer_step(), 15 / (4 / fragments));
        });
      }
    }
  }
}

// --- 2. Delay and alpha against PyTorch simulating torchft's workers -----------------------------

// Not bit for bit: Gloo sums 3 ranks in its own order (the simulation in rank order), and the
// outer Nesterov step rounds its own way; within 1e-6, the worst printed.
void expect_reference(const c10::impl::GenericDict& d, double* worst) {
  static std::mutex mu;
  const int world = static_cast<int>(d.at("world").toInt());
  run_ranks_as_threads(world, [&](comm::Group& g) {
    std::vector<at::Tensor> p = fresh(tensors(d.at("init")));
    const std::vector<at::Tensor> targets = tensors(d.at("targets").toList().get(g.rank()));
    ASSERT_EQ(d.at("outer_lr").toDouble(), 0.7);  // the script's outer optimizer is the default's
    ASSERT_EQ(d.at("outer_momentum").toDouble(), 0.9);
    auto inner =
        std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(d.at("inner_lr").toDouble())
                                                   .momentum(d.at("inner_momentum").toDouble()));
    const int64_t fragments = d.at("fragments").toInt();
    DiLoCo diloco(std::move(inner), streaming(g, d.at("sync_every").toInt(), fragments,
                                              d.at("fragment_sync_delay").toInt(),
                                              d.at("fragment_update_alpha").toDouble()));
    for (int64_t f = 0; f < fragments; ++f) {
      std::vector<int64_t> want;
      for (const auto& x : d.at("fragment_params").toList().get(f).toList()) {
        want.push_back(x.get().toInt());
      }
      ASSERT_EQ(diloco.fragment_params(f), want);
    }
    for (int64_t step = 0; step < d.at("steps").toInt(); ++step) {
      for (size_t i = 0; i < p.size(); ++i) p[i].mutable_grad() = p[i].detach() - targets[i];
      diloco.step();
    }
    const std::vector<at::Tensor> local = tensors(d.at("final_local").toList().get(g.rank()));
    const std::vector<at::Tensor> global = tensors(d.at("final_global"));
    for (size_t i = 0; i < p.size(); ++i) {
      const double dl = max_diff(p[i], local[i]),
                   dg = max_diff(diloco.global_params()[i], global[i]);
      EXPECT_LE(dl, 1e-6) << "rank " << g.rank() << " param " << i;
      EXPECT_LE(dg, 1e-6) << "param " << i;
      std::lock_guard<std::mutex> lock(mu);
      *worst = std::max({*worst, dl, dg});
    }
  });
}

TEST(DiLoCoStreamingTest, DelayAndAlphaFollowTorchftSimulatedInPyTorch) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/diloco_streaming";
  const std::string cmd = dtrain::testing::pytorch_python() +
                          " optim/testdata/make_diloco_streaming_reference.py " + dir;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream cases(dir + "/cases.txt");
  int checked = 0;
  double worst = 0;
  for (std::string name; std::getline(cases, name);) {
    if (name.empty()) continue;
    absl::StatusOr<c10::IValue> v = checkpoint::load_state(dir + "/" + name + ".pt");
    ASSERT_TRUE(v.ok()) << v.status();
    SCOPED_TRACE(name);
    expect_reference(v->toGenericDict(), &worst);
    ++checked;
  }
  EXPECT_EQ(checked, 20);  // world 1-3 x 3 schedules x alpha 0, 0.5; delay 0 alpha 0.5; alpha 1
  std::cout << "largest difference from the torchft simulation: " << worst << "\n";
}

// --- 3. The all-reduce runs behind the inner steps -----------------------------------------------

// Rank 1 does not start stepping until rank 0 has taken 3 steps of a round of 4 with delay 3:
// rank 0's all-reduce, issued after its step 1, must not block it (a blocking one would time out).
TEST(DiLoCoStreamingTest, OneRankRunsAheadWhileItsAllReduceIsInFlight) {
  for (const std::string compression : {"none", "bfloat16"}) {
    std::promise<void> ahead;
    std::shared_future<void> ahead_done = ahead.get_future().share();
    comm::testing::HarnessOptions h;
    h.timeout = std::chrono::seconds(10);
    run_ranks_as_threads(
        2,
        [&](comm::Group& g) {
          std::vector<at::Tensor> p = fresh(init_params());
          DiLoCo opt(inner_sgd(p), streaming(g, 4, 1, /*delay=*/3, 0.0, compression));
          if (g.rank() == 1) {
            ASSERT_EQ(ahead_done.wait_for(std::chrono::seconds(20)), std::future_status::ready)
                << compression << ": rank 0 did not get through inner steps 1-3";
          }
          for (int64_t step = 0; step < 3; ++step) {
            set_grads(p, g.rank(), step);
            opt.step();
          }
          if (g.rank() == 0) ahead.set_value();
          set_grads(p, g.rank(), 3);
          opt.step();  // the sync step: waits for the all-reduce
          EXPECT_EQ(opt.outer_step(), 1);
          std::vector<at::Tensor> mine = {p[0].detach().clone()};
          std::vector<std::vector<at::Tensor>> all(
              1, {at::empty_like(mine[0]), at::empty_like(mine[0])});
          g->allgather(all, mine)->wait();
          EXPECT_TRUE(all[0][0].equal(all[0][1])) << compression;  // alpha 0: the global ones
        },
        h);
  }
}

// --- 4. Resume through a state dict taken while an all-reduce is in flight -----------------------

struct ResumeCase {
  int64_t sync_every, fragments, delay;
  double alpha;
  std::string compression;
  int64_t stop;    // inner steps before the state dict
  bool in_flight;  // whether an all-reduce is in flight then
};

// A straight run S; run A, the same, whose state dict is taken after `stop` steps and saved to a
// file; run B, built over a copy of A's local parameters with another inner lr, loads it. A and B
// then equal S bit for bit at every step.
void expect_resume(const ResumeCase& c, int world) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = tmp != nullptr ? tmp : "/tmp";
  run_ranks_as_threads(world, [&](comm::Group& g) {
    const DiLoCoOptions o =
        streaming(g, c.sync_every, c.fragments, c.delay, c.alpha, c.compression);
    std::vector<at::Tensor> s = fresh(init_params()), a = fresh(init_params());
    DiLoCo run_s(inner_sgd(s), o), run_a(inner_sgd(a), o);
    for (int64_t step = 0; step < c.stop; ++step) {
      set_grads(s, g.rank(), step);
      set_grads(a, g.rank(), step);
      run_s.step();
      run_a.step();
    }
    const c10::IValue sd = run_a.state_dict();
    ASSERT_EQ(sd.toGenericDict().at("diloco").toGenericDict().contains("pending_average"),
              c.in_flight);
    const std::string path = dir + "/streaming_resume_" + std::to_string(g.rank()) + ".pt";
    ASSERT_TRUE(checkpoint::save_state(path, sd).ok());
    std::vector<at::Tensor> b = fresh(a);
    DiLoCo run_b(inner_sgd(b, 0.5), o);
    absl::StatusOr<c10::IValue> loaded = checkpoint::load_state(path);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    run_b.load_state_dict(*loaded);
    for (int64_t step = c.stop; step < c.stop + 10; ++step) {
      for (auto* p : {&s, &a, &b}) set_grads(*p, g.rank(), step);
      run_s.step();
      run_a.step();
      run_b.step();
      for (size_t i = 0; i < s.size(); ++i) {
        ASSERT_TRUE(a[i].detach().equal(s[i].detach())) << "A, step " << step << " param " << i;
        ASSERT_TRUE(b[i].detach().equal(s[i].detach())) << "B, step " << step << " param " << i;
        ASSERT_TRUE(run_b.global_params()[i].equal(run_s.global_params()[i])) << step;
      }
    }
  });
}

TEST(DiLoCoStreamingTest, ResumeThroughAnInFlightAllReduceIsBitForBit) {
  const std::vector<ResumeCase> cases = {
      {4, 1, 2, 0.5, "none", 7, true},      // after step 3 of round 2; issued after step 2
      {8, 2, 3, 0.0, "bfloat16", 6, true},  // fragment 1's, issued after its step 1
      {8, 2, 3, 0.5, "none", 9, true},      // issued by the very step before the state dict
      {6, 2, 1, 0.5, "4bit", 7, false},     // step 1 of a round: nothing in flight
      {4, 2, 0, 0.0, "none", 5, false},     // delay 0
  };
  for (const ResumeCase& c : cases) {
    for (int world : {1, 2, 3}) {
      SCOPED_TRACE("sync_every " + std::to_string(c.sync_every) + " fragments " +
                   std::to_string(c.fragments) + " delay " + std::to_string(c.delay) + " " +
                   c.compression + " world " + std::to_string(world));
      expect_resume(c, world);
    }
  }
}

// --- 5. Bad options and bad pending averages -----------------------------------------------------

TEST(DiLoCoStreamingTest, BadOptionsAreRefused) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    std::vector<at::Tensor> p = fresh(init_params());
    auto make = [&](const DiLoCoOptions& o) { DiLoCo(inner_sgd(p), o); };
    expect_error([&] { make(streaming(g, 4, 1, -1)); },
                 "DiLoCoOptions::fragment_sync_delay is -1; it is tau");
    expect_error([&] { make(streaming(g, 4, 2, 2)); },
                 "DiLoCoOptions::fragment_sync_delay is 2 but a fragment syncs every "
                 "sync_every / fragments = 2 inner steps, and its all-reduce must be issued "
                 "within the round it ends: set fragment_sync_delay to at most 1");
    expect_error([&] { make(streaming(g, 4, 1, 4)); }, "set fragment_sync_delay to at most 3");
    for (double alpha : {-0.1, 1.5, static_cast<double>(NAN)}) {
      expect_error([&] { make(streaming(g, 4, 1, 0, alpha)); },
                   "DiLoCoOptions::fragment_update_alpha is ");
    }
    expect_error([&] { make(streaming(g, 4, 1, 0, 2.0)); }, "set it in [0, 1]");
    make(streaming(g, 4, 1, 3, 1.0));  // the extremes are allowed
  });
}

TEST(DiLoCoStreamingTest, BadPendingAveragesAreRefusedLeavingTheStateAlone) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    std::vector<at::Tensor> p = fresh(init_params());
    DiLoCo opt(inner_sgd(p), streaming(g, 8, 2, 2));  // fragment 0: parameter 0, 12 elements
    for (int64_t step = 0; step < 3; ++step) {        // issued after step 2: in flight
      set_grads(p, 0, step);
      opt.step();
    }
    const c10::IValue sd = opt.state_dict();
    const at::Tensor pending =
        sd.toGenericDict().at("diloco").toGenericDict().at("pending_average").toTensor();
    ASSERT_EQ(pending.numel(), 12);
    const std::vector<std::pair<c10::IValue, std::string>> cases = {
        {with_entry(sd, "pending_average", std::nullopt),
         "diloco.pending_average is absent but local_step and fragment_sync_delay say a "
         "fragment's all-reduce was in flight"},
        {with_entry(sd, "local_step", int64_t{1}),
         "diloco.pending_average is present but local_step and fragment_sync_delay say no "
         "fragment's all-reduce was in flight"},
        {with_entry(sd, "pending_average", at::zeros({11})),
         "diloco.pending_average is not a 1-D dense tensor of 12 elements"},
        {with_entry(sd, "pending_average", at::zeros({12}, at::kDouble)),
         "diloco.pending_average is Double, the fragment's average is Float"},
        {with_entry(sd, "pending_average", at::full({12}, NAN)),
         "diloco.pending_average has a value that is not finite"},
        {with_entry(sd, "pending_average", int64_t{0}),
         "diloco.pending_average is a Int, not a tensor"},
        {with_entry(sd, "fragment_sync_delay", int64_t{1}),
         "diloco.fragment_sync_delay is 1, outside [2, 2]"},
        {with_entry(sd, "fragment_sync_delay", std::nullopt),
         "the 'diloco' entry has no 'fragment_sync_delay'"},
    };
    const at::Tensor g0 = opt.global_params()[0].clone();
    for (const auto& [bad, message] : cases) {
      expect_error([&] { opt.load_state_dict(bad); }, message);
      EXPECT_TRUE(opt.global_params()[0].equal(g0)) << message;
      EXPECT_EQ(opt.local_step(), 3) << message;
    }
    // A dict written before the option (no "fragment_sync_delay") loads where the delay is 0.
    std::vector<at::Tensor> q = fresh(init_params());
    DiLoCo blocking(inner_sgd(q), streaming(g, 8, 2, 0));
    blocking.step();
    blocking.load_state_dict(
        with_entry(blocking.state_dict(), "fragment_sync_delay", std::nullopt));
    EXPECT_EQ(blocking.local_step(), 1);
  });
}

}  // namespace
}  // namespace dtrain::optim
