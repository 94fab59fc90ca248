#include "comm/testing/replica_processes.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>

#include <gtest/gtest.h>

namespace dtrain::comm::testing {
namespace {

TEST(ReplicaProcessesTest, StartsRestartsAndReportsExits) {
  if (in_replica_process()) {
    std::printf("replica %d says %s\n", replica_id(), std::getenv("WORD"));
    std::fflush(stdout);
    if (replica_id() == 1) std::raise(SIGKILL);
    if (replica_id() == 2) std::raise(SIGSTOP);  // until the parent's SIGCONT
    std::_Exit(replica_id() + 3);
  }
  ReplicaProcesses replicas;
  ASSERT_TRUE(replicas.start(0, {{"WORD", "zero"}}).ok());
  ASSERT_TRUE(replicas.start(1, {{"WORD", "one"}}).ok());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  ASSERT_TRUE(replicas.wait_for([&] { return replicas.exited(0) && replicas.exited(1); }, deadline))
      << "replicas still running after 60 s";
  absl::StatusOr<int> again = replicas.start(1, {{"WORD", "again"}});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 2);
  ASSERT_TRUE(replicas.wait_for([&] { return replicas.exited(2); }, deadline));
  ASSERT_TRUE(replicas.start(2, {{"WORD", "two"}}).ok());
  ASSERT_TRUE(replicas.wait_for([&] { return replicas.stopped(3); }, deadline));
  EXPECT_FALSE(replicas.exited(3));
  replicas.signal(3, SIGCONT);
  ASSERT_TRUE(replicas.wait_for([&] { return replicas.exited(3); }, deadline));
  EXPECT_EQ(replicas.exit_code(3), 5);
  EXPECT_EQ(replicas.exit_code(0), 3);
  EXPECT_EQ(replicas.term_signal(1), SIGKILL);
  EXPECT_EQ(replicas.exit_code(2), 128 + SIGKILL);
  EXPECT_NE(replicas.output(0).find("replica 0 says zero"), std::string::npos)
      << replicas.output(0);
  EXPECT_NE(replicas.output(2).find("replica 1 says again"), std::string::npos)
      << replicas.output(2);
}

}  // namespace
}  // namespace dtrain::comm::testing
