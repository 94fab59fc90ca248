// Fault-tolerant DiLoCo with replica groups of several ranks (QuorumOptions::replica_group): two
// replica groups of two processes each, DDP within a group (gradients averaged over its two ranks)
// and DiLoCo across groups, rank i of each group in a quorum group of its own. Replica group 1 dies
// whole (both processes SIGKILLed, a node lost) in the middle of a round; group 0 commits the
// rounds alone after join_timeout; two new processes for group 1 join a running quorum, each
// fetches the state from its counterpart in group 0, and all four end with the same bits, equal to
// DiLoCo written out over each round's participants, every round committed once, in order.
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
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "comm/process_group.h"
#include "comm/quorum.h"
#include "comm/testing/replica_processes.h"
#include "optim/diloco.h"
#include "optim/functional/registry.h"
#include "optim/testing/diloco_testing.h"

namespace dtrain::optim {
namespace {

using comm::testing::ReplicaProcesses;
using diloco_testing::fresh;
using diloco_testing::rounds_of;

std::string out_path(int id) { return diloco_testing::result_path("diloco_quorum_group", id); }
c10::impl::GenericDict load_result(int id) { return diloco_testing::load_result(out_path(id)); }

constexpr int kGroups = 2;
constexpr int kRanks = 2;           // per replica group
constexpr int64_t kH = 3;           // inner steps per round
constexpr int64_t kMinRounds = 5;   // the ranks stop at the first full quorum from here on
constexpr int64_t kDieInRound = 2;  // group 1's first life ends in this round's inner step 1
constexpr double kLr = 0.05;

std::vector<at::Tensor> init_params() {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  return {at::randn({4, 3}, gen), at::randn({3}, gen)};
}

// The gradient of rank `local` of replica group `group` at inner step k of `round` (its own batch).
std::vector<at::Tensor> grads(const std::vector<at::Tensor>& p, int64_t group, int64_t local,
                              int64_t round, int64_t k) {
  at::Generator gen =
      at::make_generator<at::CPUGeneratorImpl>(((group * 10 + local) * 1000 + round) * 100 + k);
  const at::Tensor x = at::randn({8, 4}, gen);
  const at::Tensor y = at::randn({8, 3}, gen);
  for (const at::Tensor& t : p) t.mutable_grad() = at::Tensor();
  ((x.mm(p[0]) + p[1]) - y).pow(2).mean().backward();
  return {p[0].grad().clone(), p[1].grad().clone()};
}

// Process `id` = rank id % kRanks of replica group id / kRanks, its `life`-th start.
void run_rank(int id, int port, int life) {
  at::set_num_threads(1);
  const int group_id = id / kRanks, local = id % kRanks;
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = false;
  so.waitWorkers = false;
  so.useLibUV = false;
  comm::InitOptions io;  // the replica group's own group, met on the lighthouse's store
  io.store =
      c10::make_intrusive<c10d::PrefixStore>(absl::StrCat("group", group_id, "/", life),
                                             c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so));
  io.rank = local;
  io.world_size = kRanks;
  io.timeout = std::chrono::seconds(30);
  absl::StatusOr<comm::Group> replica_group = comm::init_process_group(io);
  TORCH_CHECK(replica_group.ok(), replica_group.status().ToString());
  comm::QuorumOptions qo;
  qo.lighthouse_port = port;
  qo.replica_id = group_id;
  qo.min_replicas = 1;
  qo.expected_replicas = kGroups;
  qo.join_timeout = std::chrono::milliseconds(1000);
  qo.quorum_timeout = std::chrono::seconds(90);
  qo.timeout = std::chrono::seconds(30);
  qo.replica_group = *replica_group;
  absl::StatusOr<std::unique_ptr<comm::QuorumClient>> client = comm::QuorumClient::connect(qo);
  TORCH_CHECK(client.ok(), client.status().ToString());
  std::vector<at::Tensor> params = fresh(init_params());
  DiLoCoOptions options;
  options.quorum = std::move(*client);
  options.sync_every = kH;
  DiLoCo opt(std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(kLr)), options);
  opt.join_quorum();
  c10::List<c10::List<int64_t>> rounds;
  for (;;) {
    const int64_t round = opt.outer_step();
    for (int64_t k = 0; k < kH; ++k) {
      if (group_id == 1 && life == 0 && round == kDieInRound && k == 1) std::raise(SIGKILL);
      std::vector<at::Tensor> g = grads(params, group_id, local, round, k);
      for (size_t i = 0; i < g.size(); ++i) {  // DDP within the replica group
        std::vector<at::Tensor> bufs = {g[i]};
        (*replica_group)->allreduce(bufs)->wait();
        params[i].mutable_grad() = g[i].div_(kRanks);
      }
      opt.step();
    }
    const std::vector<int64_t> ids = diloco_testing::record_round(
        *opt.last_quorum(), opt.outer_step() - 1, rounds, "process", id);
    if (opt.outer_step() >= kMinRounds && ids.size() == kGroups) break;
  }
  diloco_testing::save_result(out_path(id), params, opt.outer_step(), rounds);
}

// DiLoCo written out: each participating group trains kH steps of SGD on its ranks' mean
// gradient from the global parameters; the pseudo-gradients are averaged; Nesterov SGD steps.
std::vector<at::Tensor> reference(const std::vector<std::vector<int64_t>>& rounds) {
  std::vector<at::Tensor> global = init_params();
  auto outer = FunctionalRegistry::global().create("SGD", global, default_outer_options());
  diloco_testing::replay_rounds(global, *outer, rounds,
                                [](std::vector<at::Tensor>& local, int64_t group, int64_t round) {
                                  torch::optim::SGD sgd(local, torch::optim::SGDOptions(kLr));
                                  for (int64_t k = 0; k < kH; ++k) {
                                    std::vector<at::Tensor> g0 = grads(local, group, 0, round, k);
                                    std::vector<at::Tensor> g1 = grads(local, group, 1, round, k);
                                    for (size_t j = 0; j < local.size(); ++j)
                                      local[j].mutable_grad() = (g0[j] + g1[j]) / kRanks;
                                    sgd.step();
                                  }
                                });
  return global;
}

TEST(DiLoCoQuorumGroupTest, ReplicaGroupOfTwoRanksLostWholeRejoinsFromPeers) {
  if (comm::testing::in_replica_process()) {
    int port = 0, life = 0;
    TORCH_CHECK(absl::SimpleAtoi(std::getenv("LIGHTHOUSE_PORT"), &port));
    TORCH_CHECK(absl::SimpleAtoi(std::getenv("LIFE"), &life));
    run_rank(comm::testing::replica_id(), port, life);
    std::_Exit(::testing::Test::HasFailure() ? 1 : 0);
  }
  comm::Lighthouse lighthouse;
  const std::string port = std::to_string(lighthouse.port());
  ReplicaProcesses procs;  // index = process id in the first life; 4 and 5: group 1 restarted
  for (int id = 0; id < kGroups * kRanks; ++id) {
    ASSERT_TRUE(procs.start(id, {{"LIGHTHOUSE_PORT", port}, {"LIFE", "0"}}).ok());
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(100);
  auto dump = [&] { return procs.outputs(); };
  ASSERT_TRUE(procs.wait_for(
      [&] {
        return procs.exited(2) && procs.exited(3) &&
               procs.output(0).find("participants 0\n") != std::string::npos;
      },
      deadline))
      << "group 1 did not die, or group 0 did not go on without it:\n"
      << dump();
  ASSERT_EQ(procs.term_signal(2), SIGKILL) << dump();
  ASSERT_EQ(procs.term_signal(3), SIGKILL) << dump();
  for (int id : {2, 3})
    ASSERT_TRUE(procs.start(id, {{"LIGHTHOUSE_PORT", port}, {"LIFE", "1"}}).ok());
  const std::vector<int> last = {0, 1, 4, 5};
  ASSERT_TRUE(procs.wait_for(
      [&] {
        int done = 0;
        for (int i : last) {
          if (!procs.exited(i)) continue;
          if (procs.exit_code(i) != 0) return true;
          ++done;
        }
        return done == 4;
      },
      deadline))
      << "processes still running after 100 s (hung?):\n"
      << dump();
  for (int i : last) ASSERT_EQ(procs.exit_code(i), 0) << "process " << i << "\n" << dump();

  const std::vector<std::vector<int64_t>> rounds = rounds_of(load_result(0));
  ASSERT_GE(rounds.size(), static_cast<size_t>(kMinRounds));
  for (size_t i = 0; i < rounds.size(); ++i) ASSERT_EQ(rounds[i][0], static_cast<int64_t>(i));
  EXPECT_EQ(rounds[0], (std::vector<int64_t>{0, 0, 1}));
  EXPECT_EQ(rounds[kDieInRound], (std::vector<int64_t>{kDieInRound, 0}));
  EXPECT_EQ(std::vector<int64_t>(rounds.back().begin() + 1, rounds.back().end()),
            (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(rounds_of(load_result(1)), rounds);
  EXPECT_EQ(rounds_of(load_result(2)), rounds_of(load_result(3)));  // group 1's ranks agree
  const std::vector<at::Tensor> p0 = diloco_testing::tensors(load_result(0).at("params"));
  for (int id : {1, 2, 3}) {
    const std::vector<at::Tensor> p = diloco_testing::tensors(load_result(id).at("params"));
    for (size_t j = 0; j < p0.size(); ++j)
      EXPECT_TRUE(p[j].equal(p0[j])) << "process " << id << " parameter " << j << " differs by "
                                     << diloco_testing::max_diff(p[j], p0[j]);
  }
  const std::vector<at::Tensor> ref = reference(rounds);
  for (size_t j = 0; j < ref.size(); ++j) {
    EXPECT_LE(diloco_testing::max_diff(p0[j], ref[j]), 1e-6) << "parameter " << j;
  }
  std::cout << rounds.size() << " rounds; group 1 died in round " << kDieInRound << "\n";
}

}  // namespace
}  // namespace dtrain::optim
