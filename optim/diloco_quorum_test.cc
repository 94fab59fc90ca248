// Fault-tolerant DiLoCo (DiLoCoOptions::quorum) with replicas as processes: three replicas train;
// replica 1 dies of SIGKILL in the middle of a round; the other two commit that round and the next
// ones among themselves (after join_timeout); a new process for replica 1 joins a running quorum,
// receives the state over the network, and all three end with the same bits, equal to DiLoCo
// written out over the pseudo-gradients of each round's participants, every round committed once.
// The same with replica 1 stopped (SIGSTOP, as if cut off) and continued: it catches up from a peer.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "comm/quorum.h"
#include "comm/testing/replica_processes.h"
#include "optim/diloco.h"
#include "optim/functional/registry.h"
#include "optim/testing/diloco_testing.h"
#include "testing/test_util.h"

namespace dtrain::optim {
namespace {

using comm::testing::ReplicaProcesses;
using diloco_testing::fresh;
using diloco_testing::rounds_of;

std::string out_path(int id) { return diloco_testing::result_path("diloco_quorum_replica", id); }
c10::impl::GenericDict load_result(int id) { return diloco_testing::load_result(out_path(id)); }

constexpr int kReplicas = 3;
constexpr int64_t kH = 4;           // inner steps per round
constexpr int64_t kMinRounds = 6;   // the replicas stop at the first full quorum from here on
constexpr int64_t kDieInRound = 2;  // replica 1's first life ends in this round's inner step 1
constexpr double kLr = 0.05;

std::vector<at::Tensor> init_params() {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  return {at::randn({4, 3}, gen), at::randn({3}, gen)};
}

// Inner step k of `round` on replica `replica`'s data: a least-squares loss on its own batch.
void inner_step(const std::vector<at::Tensor>& p, torch::optim::Optimizer& opt, int64_t replica,
                int64_t round, int64_t k) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>((replica * 1000 + round) * 100 + k);
  const at::Tensor x = at::randn({8, 4}, gen);
  const at::Tensor y = at::randn({8, 3}, gen);
  opt.zero_grad();
  ((x.mm(p[0]) + p[1]) - y).pow(2).mean().backward();
  opt.step();
}

// A replica's life: join, train until a full quorum has committed kMinRounds or more, save the
// parameters and the rounds it saw ([step, participant ids...] each) for the parent.
// kKill: replica 1 dies (SIGKILL) and a new process replaces it; kStop: it stops (SIGSTOP, as a
// replica cut off) until the parent's SIGCONT, then goes on as the same process.
enum class Fault { kKill, kStop };

void run_replica(int id, int port, Fault fault, bool restarted) {
  at::set_num_threads(1);
  comm::QuorumOptions qo;
  qo.lighthouse_port = port;
  qo.replica_id = id;
  qo.min_replicas = 2;
  qo.expected_replicas = kReplicas;
  qo.join_timeout = std::chrono::milliseconds(1000);
  qo.quorum_timeout = std::chrono::seconds(90);
  qo.timeout = std::chrono::seconds(30);
  absl::StatusOr<std::unique_ptr<comm::QuorumClient>> client = comm::QuorumClient::connect(qo);
  TORCH_CHECK(client.ok(), client.status().ToString());
  std::vector<at::Tensor> params = fresh(init_params());
  DiLoCoOptions options;
  options.quorum = std::move(*client);
  options.sync_every = kH;
  DiLoCo opt(std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(kLr)), options);
  opt.join_quorum();
  std::printf("replica %d joined at step %lld in %s\n", id,
              static_cast<long long>(opt.outer_step()), opt.last_quorum()->describe().c_str());
  c10::List<c10::List<int64_t>> rounds;
  for (;;) {
    const int64_t round = opt.outer_step();
    for (int64_t k = 0; k < kH; ++k) {
      if (id == 1 && !restarted && round == kDieInRound && k == 1) {
        std::raise(fault == Fault::kKill ? SIGKILL : SIGSTOP);
      }
      inner_step(params, opt, id, round, k);
    }
    const std::vector<int64_t> ids = diloco_testing::record_round(
        *opt.last_quorum(), opt.outer_step() - 1, rounds, "replica", id);
    if (opt.outer_step() >= kMinRounds && ids.size() == kReplicas) break;
  }
  diloco_testing::save_result(out_path(id), params, opt.outer_step(), rounds);
}

// DiLoCo written out over the rounds' participants: each trains kH steps of plain SGD from the
// global parameters, the pseudo-gradients are averaged, Nesterov SGD (lr 0.7, momentum 0.9) steps.
std::vector<at::Tensor> reference(const std::vector<std::vector<int64_t>>& rounds) {
  std::vector<at::Tensor> global = init_params();
  auto outer = FunctionalRegistry::global().create("SGD", global, default_outer_options());
  diloco_testing::replay_rounds(global, *outer, rounds,
                                [](std::vector<at::Tensor>& local, int64_t id, int64_t round) {
                                  torch::optim::SGD sgd(local, torch::optim::SGDOptions(kLr));
                                  for (int64_t k = 0; k < kH; ++k)
                                    inner_step(local, sgd, id, round, k);
                                });
  return global;
}

// The fault on replica 1 in round kDieInRound; the others go on; replica 1 comes back (a new
// process for kKill, the same one for kStop) and every replica ends with the same bits.
void run_fault_test(Fault fault) {
  if (comm::testing::in_replica_process()) {
    int port = 0;
    TORCH_CHECK(absl::SimpleAtoi(std::getenv("LIGHTHOUSE_PORT"), &port));
    run_replica(comm::testing::replica_id(), port, fault, std::getenv("RESTARTED") != nullptr);
    std::fflush(stdout);
    std::_Exit(::testing::Test::HasFailure() ? 1 : 0);
  }
  comm::Lighthouse lighthouse;
  const std::string port = std::to_string(lighthouse.port());
  ReplicaProcesses replicas;
  for (int id = 0; id < kReplicas; ++id) {
    ASSERT_TRUE(replicas.start(id, {{"LIGHTHOUSE_PORT", port}}).ok());
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(100);
  auto dump = [&] { return replicas.outputs(); };
  // Replica 1 dies or stops; the two others commit a round without it.
  const bool kill = fault == Fault::kKill;
  ASSERT_TRUE(replicas.wait_for(
      [&] {
        return (!kill || replicas.exited(1)) &&
               replicas.output(0).find("participants 0,2\n") != std::string::npos;
      },
      deadline))
      << "replica 1 did not die or stop, or replicas 0 and 2 did not go on without it:\n"
      << dump();
  if (kill) {
    EXPECT_EQ(replicas.term_signal(1), SIGKILL) << dump();
    ASSERT_TRUE(replicas.start(1, {{"LIGHTHOUSE_PORT", port}, {"RESTARTED", "1"}}).ok());
  } else {
    ASSERT_FALSE(replicas.exited(1)) << dump();
    replicas.signal(1, SIGCONT);
  }
  const std::vector<int> last = {0, 2, kill ? 3 : 1};  // the processes that must end well
  ASSERT_TRUE(replicas.wait_for(
      [&] {
        int done = 0;
        for (int i : last) {
          if (!replicas.exited(i)) continue;
          if (replicas.exit_code(i) != 0) return true;  // failed: the others would wait for it
          ++done;
        }
        return done == 3;
      },
      deadline))
      << "replicas still running after 100 s (hung?):\n"
      << dump();
  for (int i : last) ASSERT_EQ(replicas.exit_code(i), 0) << "process " << i << "\n" << dump();

  const c10::impl::GenericDict r0 = load_result(0);
  const std::vector<std::vector<int64_t>> rounds = rounds_of(r0);
  // Every round committed once, in order, the first two by all, then some by 0 and 2 alone, the
  // last by all again.
  for (size_t i = 0; i < rounds.size(); ++i) ASSERT_EQ(rounds[i][0], static_cast<int64_t>(i));
  ASSERT_GE(rounds.size(), static_cast<size_t>(kMinRounds));
  EXPECT_EQ(rounds[0], (std::vector<int64_t>{0, 0, 1, 2}));
  EXPECT_EQ(rounds[1], (std::vector<int64_t>{1, 0, 1, 2}));
  EXPECT_EQ(rounds[kDieInRound], (std::vector<int64_t>{kDieInRound, 0, 2}));
  EXPECT_EQ(std::vector<int64_t>(rounds.back().begin() + 1, rounds.back().end()),
            (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(r0.at("outer_step").toInt(), static_cast<int64_t>(rounds.size()));
  EXPECT_EQ(rounds_of(load_result(2)), rounds);
  // Replica 1 saw the rounds before the fault (its first life's are lost with it when killed),
  // then those from the one it was admitted at.
  const std::vector<std::vector<int64_t>> seen = rounds_of(load_result(1));
  const size_t before = kill ? 0 : static_cast<size_t>(kDieInRound);
  ASSERT_GT(seen.size(), before);
  const size_t from = static_cast<size_t>(seen[before][0]);
  ASSERT_GT(from, static_cast<size_t>(kDieInRound));
  std::vector<std::vector<int64_t>> expected(rounds.begin(), rounds.begin() + before);
  expected.insert(expected.end(), rounds.begin() + from, rounds.end());
  EXPECT_EQ(seen, expected);
  std::cout << rounds.size() << " rounds; replica 1 " << (kill ? "died" : "stopped") << " in round "
            << kDieInRound << " and was back from round " << from << "\n";
  const std::vector<at::Tensor> p0 = diloco_testing::tensors(r0.at("params"));
  for (int id : {1, 2}) {
    const c10::impl::GenericDict d = load_result(id);
    EXPECT_EQ(d.at("outer_step").toInt(), r0.at("outer_step").toInt()) << "replica " << id;
    const std::vector<at::Tensor> p = diloco_testing::tensors(d.at("params"));
    for (size_t j = 0; j < p0.size(); ++j)
      EXPECT_TRUE(p[j].equal(p0[j])) << "replica " << id << " parameter " << j << " differs by "
                                     << diloco_testing::max_diff(p[j], p0[j]);
  }
  const std::vector<at::Tensor> ref = reference(rounds);
  for (size_t j = 0; j < ref.size(); ++j) {
    EXPECT_LE(diloco_testing::max_diff(p0[j], ref[j]), 1e-6) << "parameter " << j;
  }
}

TEST(DiLoCoQuorumTest, SurvivesAKilledReplicaWhichRejoinsFromAPeer) {
  run_fault_test(Fault::kKill);
}

TEST(DiLoCoQuorumTest, DropsAStoppedReplicaWhichCatchesUpFromAPeer) {
  run_fault_test(Fault::kStop);
}

// What the fault-tolerant sync does not take, refused at construction, each naming the option.
TEST(DiLoCoQuorumTest, RefusesWhatItDoesNotSupport) {
  comm::Lighthouse lighthouse;
  comm::QuorumOptions qo;
  qo.lighthouse_port = lighthouse.port();
  qo.replica_id = 0;
  absl::StatusOr<std::unique_ptr<comm::QuorumClient>> client = comm::QuorumClient::connect(qo);
  ASSERT_TRUE(client.ok()) << client.status();
  std::shared_ptr<comm::QuorumClient> shared = std::move(*client);
  std::vector<at::Tensor> params = fresh(init_params());
  auto make = [&](const std::function<void(DiLoCoOptions&)>& edit) {
    DiLoCoOptions o;
    o.quorum = shared;
    o.sync_every = kH;
    edit(o);
    DiLoCo(std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(kLr)), o);
  };
  using test_util::expect_error;
  expect_error([&] { make([](DiLoCoOptions& o) { o.fragments = 2; }); },
               "the fault-tolerant sync supports plain DiLoCo only");
  expect_error([&] { make([](DiLoCoOptions& o) { o.outer_compression = "4bit"; }); },
               "outer_compression '4bit'");
  expect_error([&] { make([](DiLoCoOptions& o) { o.max_quorum_retries = 0; }); },
               "max_quorum_retries is 0");
  expect_error(
      [&] {
        DiLoCo opt(std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(kLr)), [&] {
          DiLoCoOptions o;
          o.sync_every = kH;
          return o;
        }());
      },
      "DiLoCoOptions::group is not set");
}

}  // namespace
}  // namespace dtrain::optim
