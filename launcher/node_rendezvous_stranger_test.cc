// The node rendezvous against strangers (issue 39): HELLOs without this job's run id, for a node
// whose launcher is alive, or that do not fit, before the real node joins and mid-run -- each is
// answered and forgotten, never node 0's error, and the job goes on with the real nodes.
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <latch>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "launcher/internal/line_conn.h"
#include "launcher/node_rendezvous.h"
#include "launcher/node_rendezvous_testing.h"
#include "launcher/process_set.h"

namespace dtrain::comm {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using namespace testing;  // NOLINT: the helpers

// A node whose launcher was given other settings or another --rdzv_id is refused: its launcher
// fails naming the difference, and node 0 -- which cannot tell it from a stranger -- reports the
// refusal and goes on waiting for a node that fits (here until a signal cancels the wait).
TEST(NodeRendezvousJoinTest, ANodeThatDisagreesIsRefusedAndNodeZeroWaitsOn) {
  for (const bool other_id : {false, true}) {
    const int port = free_port("127.0.0.1");
    std::atomic<bool> refused{false};
    std::string reported;
    run_nodes(2, [&](int k) {
      NodeRendezvousOptions o = options(2, k, port);
      if (k == 1 && other_id) o.rdzv_id = "job-8";
      if (k == 1 && !other_id) o.nproc_per_node = 4;
      if (k == 0) {
        o.on_refused = [&](const std::string& why) {
          reported = why;
          refused = true;
        };
        o.pending_signal = [&] { return refused ? SIGTERM : 0; };
      }
      auto r = join(o);
      ASSERT_NE(r, nullptr);
      absl::StatusOr<AttemptPlan> plan = r->next_attempt();
      ASSERT_FALSE(plan.ok());
      if (k == 0) {
        EXPECT_TRUE(absl::IsCancelled(plan.status())) << plan.status();
        return;
      }
      EXPECT_TRUE(absl::IsInvalidArgument(plan.status())) << plan.status();
      EXPECT_THAT(plan.status().message(),
                  HasSubstr(other_id ? "launch: node 0 refused this node: node 1's --rdzv_id "
                                       "\"job-8\" is not this job's; give every node's launcher "
                                       "the same --rdzv_id"
                                     : "launch: node 0 refused this node: node 1 has "
                                       "nproc_per_node 4, nnodes 2, max_restarts 1; node 0 has "
                                       "1, 2, 1; give every node the same"));
    });
    EXPECT_THAT(reported, StartsWith("127.0.0.1:"));
    EXPECT_THAT(reported, HasSubstr(other_id ? "node 1's --rdzv_id \"job-8\" is not this job's"
                                             : "node 1 has nproc_per_node 4"));
  }
}

TEST(NodeRendezvousJoinTest, NoNodeZeroIsADeadlineNamingItsAddress) {
  NodeRendezvousOptions o = options(2, 1, free_port("127.0.0.1"));
  o.join_timeout = 700ms;
  absl::StatusOr<std::unique_ptr<NodeRendezvous>> r = NodeRendezvous::join(o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(r.status())) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("could not reach node 0's launcher at 127.0.0.1:" +
                                              std::to_string(o.master_port) + " within 0.7 s"));
}

TEST(NodeRendezvousJoinTest, NodeZeroNamesTheNodesThatNeverCame) {
  NodeRendezvousOptions o = options(3, 0, free_port("127.0.0.1"));
  o.join_timeout = 500ms;
  auto r = join(o);
  ASSERT_NE(r, nullptr);
  absl::StatusOr<AttemptPlan> plan = r->next_attempt();
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(plan.status())) << plan.status();
  EXPECT_THAT(plan.status().message(), HasSubstr("nodes 1, 2 did not join attempt 0 within 0.5 s"));
}

// The join deadline names the last connection node 0 refused: the misconfigured node's reason.
TEST(NodeRendezvousJoinTest, NodeZeroNamesTheLastRefusalAtItsDeadline) {
  NodeRendezvousOptions o = options(2, 0, free_port("127.0.0.1"));
  o.join_timeout = 2s;
  auto r = join(o);
  ASSERT_NE(r, nullptr);
  absl::StatusOr<int> fd = internal::connect_to("127.0.0.1", o.master_port);
  ASSERT_TRUE(fd.ok()) << fd.status();
  const std::string hello = "HELLO 1 1 2 1 job-8\n";  // waiting for node 0 when it starts to wait
  ASSERT_EQ(::write(*fd, hello.data(), hello.size()), static_cast<ssize_t>(hello.size()));
  absl::StatusOr<AttemptPlan> plan = r->next_attempt();
  ::close(*fd);
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(plan.status())) << plan.status();
  EXPECT_THAT(plan.status().message(),
              HasSubstr("nodes 1 did not join attempt 0 within 2 s (node 0 listens at 127.0.0.1:" +
                        std::to_string(o.master_port) +
                        "); start their launchers with the same --master_addr, --nnodes, "
                        "--nproc_per_node, --max_restarts and --rdzv_id; the last connection node "
                        "0 refused: 127.0.0.1:"));
  EXPECT_THAT(plan.status().message(),
              HasSubstr(": node 1's --rdzv_id \"job-8\" is not this job's"));
}

// What a job of two nodes saw while strangers called on node 0 during its first attempt.
struct WithStrangers {
  std::vector<std::string> replies;             // node 0's answer to each stranger
  std::vector<std::string> refused;             // what node 0 reported (on_refused)
  std::vector<std::vector<std::string>> stops;  // per node: what poll() said during the strangers
  std::vector<std::vector<int>> attempts;       // per node: the attempts it started
  std::vector<std::vector<int>> worker_ports;   // per node: their worker ports
  std::vector<Verdict> verdicts;                // per node: the last
};

// Nodes 0 and 1 start attempt 0; then each of `strangers` connects to node 0, sends its bytes and
// reads node 0's answer to the end, while both nodes poll. Then node 1 ends the attempt: with a
// failure of its rank 1 when `then_fail` (node 0 is told, both restart into attempt 1 and succeed),
// else with success.
WithStrangers run_with_strangers(const std::vector<std::string>& strangers, bool then_fail) {
  const int port = free_port("127.0.0.1");
  WithStrangers w;
  w.stops.resize(2);
  w.attempts.resize(2);
  w.worker_ports.resize(2);
  w.verdicts.resize(2);
  std::latch started(2);
  std::atomic<bool> strangers_done{false};
  std::mutex mu;
  run_nodes(3, [&](int k) {
    if (k == 2) {
      started.wait();
      for (const std::string& bytes : strangers) w.replies.push_back(stranger(port, bytes));
      strangers_done = true;
      return;
    }
    NodeRendezvousOptions o = options(2, k, port);
    o.on_refused = [&](const std::string& why) {
      std::lock_guard<std::mutex> lock(mu);
      w.refused.push_back(why);
    };
    auto r = join(o);
    absl::StatusOr<AttemptPlan> plan =
        r != nullptr ? r->next_attempt() : absl::UnknownError("no join");
    started.count_down();  // whatever happened: the strangers must not wait for ever
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (;;) {
      w.attempts[k].push_back(plan->attempt);
      w.worker_ports[k].push_back(plan->worker_port);
      while (plan->attempt == 0 && !strangers_done) {  // node 0 answers the strangers meanwhile
        if (std::optional<std::string> why = r->poll()) w.stops[k].push_back(*why);
        std::this_thread::sleep_for(5ms);
      }
      NodeResult result = succeeded();
      if (then_fail && plan->attempt == 0) {
        result = NodeResult{};
        if (k == 1) {
          result.rank = 1;
          result.code = 3;
          r->report_failure(1, 3, false);
        } else {
          EXPECT_EQ(wait_for_stop(*r), "rank 1 (node 1) exited with code 3");
        }
      }
      absl::StatusOr<Verdict> v = r->finish(result);
      ASSERT_TRUE(v.ok()) << "node " << k << ": " << v.status();
      w.verdicts[k] = *v;
      if (v->exit) return;
      plan = r->next_attempt();
      ASSERT_TRUE(plan.ok()) << "node " << k << ": " << plan.status();
    }
  });
  return w;
}

// The stranger: a HELLO of node 1 without a run id, then READY, mid-run. Before, node 0
// took it for node 1, stopped every rank, restarted with it and lost the real node 1. Now it is
// refused, and so is a HELLO with another job's run id; the job goes on and ends with 0.
TEST(NodeRendezvousStrangerTest, HellosWithoutOrWithAnotherRunIdAreRefusedMidRun) {
  const WithStrangers w = run_with_strangers(
      {"HELLO 1 1 2 1\nREADY 1\n", "HELLO 1 1 2 1 another-job\nREADY 1\n"}, false);
  ASSERT_EQ(w.replies.size(), 2u);
  EXPECT_EQ(
      w.replies[0],
      "ERROR node 1's HELLO carries no run id (\"HELLO 1 1 2 1\"); every node's launcher must "
      "be given the same --rdzv_id (a launcher of an older dtrain?)\n");
  EXPECT_EQ(w.replies[1],
            "ERROR node 1's --rdzv_id \"another-job\" is not this job's; give every node's "
            "launcher the same --rdzv_id\n");
  ASSERT_EQ(w.refused.size(), 2u);
  EXPECT_THAT(w.refused[0], StartsWith("127.0.0.1:"));
  EXPECT_THAT(w.refused[0], HasSubstr(": node 1's HELLO carries no run id"));
  for (int k = 0; k < 2; ++k) {
    EXPECT_TRUE(w.stops[k].empty()) << "node " << k << " was stopped: " << w.stops[k][0];
    EXPECT_EQ(w.attempts[k], std::vector<int>{0}) << "node " << k;
    EXPECT_TRUE(w.verdicts[k].exit && w.verdicts[k].code == 0) << "node " << k;
  }
}

// A second HELLO for node 1 while node 1's launcher is alive -- right run id and settings -- is
// answered BUSY and dropped; the real node 1 keeps its place and the job ends with 0.
TEST(NodeRendezvousStrangerTest, ASecondHelloForALiveNodeIsRefused) {
  const WithStrangers w = run_with_strangers({"HELLO 1 1 2 1 none\nREADY 1\n"}, false);
  ASSERT_EQ(w.replies.size(), 1u);
  EXPECT_EQ(w.replies[0],
            "BUSY node 1's launcher is connected and alive; another launcher for node 1 is let in "
            "once node 0 has lost it (its connection closed, or no word for 1 s)\n");
  EXPECT_EQ(w.refused.size(), 1u);
  for (int k = 0; k < 2; ++k) {
    EXPECT_TRUE(w.stops[k].empty()) << "node " << k << " was stopped: " << w.stops[k][0];
    EXPECT_EQ(w.attempts[k], std::vector<int>{0}) << "node " << k;
    EXPECT_TRUE(w.verdicts[k].exit && w.verdicts[k].code == 0) << "node " << k;
  }
}

// A stranger's mismatch (the "HELLO 1 3 2 1", another nnodes with the right run id,
// garbage) mid-run is not node 0's error: before, node 0 kept the refusal and, at the restart that
// followed, exited blaming node 1. Now both nodes restart into attempt 1 together and end with 0.
TEST(NodeRendezvousStrangerTest, AStrangersRefusalIsNotNodeZerosErrorAtTheNextRestart) {
  const WithStrangers w = run_with_strangers(
      {"HELLO 1 3 2 1\n", "HELLO 1 1 3 1 none\n", "HELLO 1 1 2 1 none extra\n", "\x16\x03\x01\n"},
      true);
  ASSERT_EQ(w.replies.size(), 4u);
  for (const std::string& reply : w.replies) EXPECT_THAT(reply, StartsWith("ERROR ")) << reply;
  EXPECT_THAT(w.replies[1], HasSubstr("node 1 has nproc_per_node 1, nnodes 3, max_restarts 1"));
  EXPECT_EQ(w.refused.size(), 4u);
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(w.attempts[k], (std::vector<int>{0, 1})) << "node " << k;
    EXPECT_TRUE(w.verdicts[k].exit && w.verdicts[k].code == 0) << "node " << k;
  }
  EXPECT_EQ(w.worker_ports[0], w.worker_ports[1]);
}

// Strangers that do not fit call before node 1 has joined: node 0 answers them and keeps waiting
// (before, it ended its launch at once), and runs the job with the real node 1 when it comes.
TEST(NodeRendezvousStrangerTest, NodeZeroWaitsOnPastStrangersForTheRealNode) {
  const int port = free_port("127.0.0.1");
  std::vector<std::string> replies;
  run_nodes(2, [&](int k) {
    if (k == 1) {  // first the strangers, then node 1's launcher
      for (const char* bytes : {"HELLO 1 3 2 1\n", "HELLO 1 1 3 1 none\n", "HELLO 5 1 2 1 none\n"})
        replies.push_back(stranger(port, bytes));
    }
    auto r = join(options(2, k, port));
    ASSERT_NE(r, nullptr);
    absl::StatusOr<AttemptPlan> plan = r->next_attempt();
    ASSERT_TRUE(plan.ok()) << "node " << k << ": " << plan.status();
    absl::StatusOr<Verdict> v = r->finish(succeeded());
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_TRUE(v->exit && v->code == 0);
  });
  ASSERT_EQ(replies.size(), 3u);
  EXPECT_THAT(replies[0], StartsWith("ERROR node 1's HELLO carries no run id"));
  EXPECT_THAT(replies[1], StartsWith("ERROR node 1 has nproc_per_node 1, nnodes 3"));
  EXPECT_EQ(replies[2], "ERROR node_rank 5 is not in [1, 1]\n");
}

// A new launcher for node 1 while node 0 still holds the old one (its host gone, not yet noticed)
// is told BUSY and tries again; once node 0 loses the old one, the new one joins the next attempt.
TEST(NodeRendezvousLossTest, ANewLauncherForALiveNodeWaitsForItsPlace) {
  const int port = free_port("127.0.0.1");
  std::atomic<bool> busy_told{false};
  std::latch first_started(1);
  std::thread node1([&] {
    auto old_launcher = join(options(2, 1, port));
    ASSERT_NE(old_launcher, nullptr);
    ASSERT_TRUE(old_launcher->next_attempt().ok());
    first_started.count_down();
    std::thread successor([&] {
      auto r = join(options(2, 1, port));
      ASSERT_NE(r, nullptr);
      absl::StatusOr<AttemptPlan> plan = r->next_attempt();  // BUSY until the old one is gone
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_EQ(plan->attempt, 1);
      absl::StatusOr<Verdict> v = r->finish(succeeded());
      ASSERT_TRUE(v.ok()) << v.status();
      EXPECT_TRUE(v->exit && v->code == 0);
    });
    for (int i = 0; !busy_told && i < 6000; ++i) {  // the old one heartbeats meanwhile
      EXPECT_EQ(old_launcher->poll(), std::nullopt);
      std::this_thread::sleep_for(5ms);
    }
    EXPECT_TRUE(busy_told) << "node 0 never told the successor BUSY";
    old_launcher.reset();  // gone: its connection closes
    successor.join();
  });
  NodeRendezvousOptions o = options(2, 0, port);
  o.on_refused = [&](const std::string& why) {
    if (why.find(": node 1's launcher is connected and alive") != std::string::npos)
      busy_told = true;
  };
  auto r = join(o);
  ASSERT_NE(r, nullptr);
  ASSERT_TRUE(r->next_attempt().ok());
  first_started.wait();
  std::optional<std::string> why;
  for (int i = 0; !why && i < 6000; ++i, std::this_thread::sleep_for(5ms)) why = r->poll();
  EXPECT_EQ(why, "node 1's launcher was lost: its connection closed");
  absl::StatusOr<Verdict> v = r->finish(NodeResult{});
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_FALSE(v->exit);
  absl::StatusOr<AttemptPlan> plan = r->next_attempt();
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->attempt, 1);
  v = r->finish(succeeded());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(v->exit && v->code == 0);
  node1.join();
}

}  // namespace
}  // namespace dtrain::comm
