#include "comm/heartbeat.h"

#include <signal.h>
#include <unistd.h>

#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"

namespace dtrain::comm {
namespace {

using ::testing::HasSubstr;

TEST(HeartbeatTest, AllAliveOverThreads) {
  testing::run_ranks_as_threads(3, [](Group& g) {
    Heartbeat hb(g, std::chrono::milliseconds(100));
    EXPECT_EQ(hb.describe_stalls(), "every rank is alive (heartbeats continue)");
  });
}

// Rank 1 stops itself (SIGSTOP) in the middle of the job: rank 0's allreduce times out and its
// heartbeat reader names rank 1; rank 0 then lets it continue so the test can end.
TEST(HeartbeatTest, AStoppedRankIsNamedAfterACollectiveTimesOut) {
  testing::HarnessOptions o;
  o.timeout = std::chrono::seconds(3);
  testing::run_ranks_as_processes(
      2,
      [](Group& g) {
        Heartbeat hb(g, std::chrono::milliseconds(200));
        std::vector<at::Tensor> t = {at::ones({4})};
        g->allreduce(t)->wait();  // both running
        if (g.rank() == 1) {
          const std::string pid = std::to_string(::getpid());
          g.store()->set("pid1", std::vector<uint8_t>(pid.begin(), pid.end()));
          ::raise(SIGSTOP);
          try {
            g->allreduce(t)->wait();  // rank 0 has given up on this one by now
          } catch (const std::exception&) {
          }
          return;
        }
        bool timed_out = false;
        try {
          g->allreduce(t)->wait();
        } catch (const std::exception&) {
          timed_out = true;
        }
        EXPECT_TRUE(timed_out);
        const std::string said = hb.describe_stalls();
        const std::vector<uint8_t> pid = g.store()->get("pid1");
        ::kill(std::stoi(std::string(pid.begin(), pid.end())), SIGCONT);
        EXPECT_THAT(said, HasSubstr("rank 1 stopped responding"));
      },
      o);
}

}  // namespace
}  // namespace dtrain::comm
