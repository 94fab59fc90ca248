#include "launcher/local_launcher.h"

#include <signal.h>

#include <cmath>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace dtrain::comm {
namespace {

void my_handler(int) {}

// launch_local installs its own handlers while it runs; the caller's come back afterwards, on
// success and on error alike.
TEST(LocalLauncherTest, RestoresTheCallersSignalHandlers) {
  struct sigaction mine {};
  mine.sa_handler = my_handler;
  ::sigemptyset(&mine.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ASSERT_EQ(::sigaction(sig, &mine, nullptr), 0);
  LaunchOptions o;
  o.nproc_per_node = 2;
  absl::StatusOr<int> ok = launch_local({"/bin/true"}, o);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, 0);
  absl::StatusOr<int> failing = launch_local({"/bin/sh", "-c", "exit 3"}, o);
  ASSERT_TRUE(failing.ok());
  EXPECT_EQ(*failing, 3);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction now {};
    ASSERT_EQ(::sigaction(sig, nullptr, &now), 0);
    EXPECT_EQ(now.sa_handler, &my_handler) << "signal " << sig << " was not restored";
  }
}

// Every number is bounded, and nnodes x nproc_per_node is formed in 64 bits (issue 29: nnodes
// 2147483647 x 2 ranks launched with WORLD_SIZE=-2). A bad option is InvalidArgument naming it and
// its range, and nothing starts: the program would exit 9.
TEST(LocalLauncherTest, OutOfRangeOptionsAreRefusedBeforeAnyRankStarts) {
  struct Case {
    void (*set)(LaunchOptions&);
    const char* expected;
  };
  const Case cases[] = {
      {[](LaunchOptions& o) { o.nproc_per_node = 2, o.nnodes = 2147483647, o.node_rank = 1; },
       "launch: nnodes must be in [1, 1073741824], got 2147483647"},
      {[](LaunchOptions& o) { o.nproc_per_node = 2, o.nnodes = 1 << 30, o.node_rank = 1; },
       "launch: nnodes x nproc_per_node = 1073741824 x 2 = 2147483648 ranks, more than the "
       "1073741824"},
      {[](LaunchOptions& o) { o.nproc_per_node = 256, o.nnodes = 1 << 23; }, "= 2147483648 ranks"},
      {[](LaunchOptions& o) { o.nproc_per_node = 0; },
       "launch: nproc_per_node must be in [1, 256], got 0"},
      {[](LaunchOptions& o) { o.nproc_per_node = 257; },
       "launch: nproc_per_node must be in [1, 256], got 257"},
      {[](LaunchOptions& o) { o.nnodes = -5; },
       "launch: nnodes must be in [1, 1073741824], got -5"},
      {[](LaunchOptions& o) { o.nnodes = 3, o.node_rank = 3; },
       "launch: node_rank must be in [0, 2], got 3"},
      {[](LaunchOptions& o) { o.node_rank = -2147483647 - 1; },
       "launch: node_rank must be in [0, 0], got -2147483648"},
      {[](LaunchOptions& o) { o.master_port = 65536; },
       "launch: master_port must be in [0, 65535], got 65536"},
      {[](LaunchOptions& o) { o.master_port = -1; },
       "launch: master_port must be in [0, 65535], got -1"},
      {[](LaunchOptions& o) { o.max_restarts = 101; },
       "launch: max_restarts must be in [0, 100], got 101"},
      {[](LaunchOptions& o) { o.stop_grace_seconds = -0.5; },
       "launch: stop_grace_seconds must be in [0, 3600], got -0.5"},
      {[](LaunchOptions& o) { o.stop_grace_seconds = 1e10; },
       "launch: stop_grace_seconds must be in [0, 3600]"},
      {[](LaunchOptions& o) { o.stop_grace_seconds = std::nan(""); },
       "launch: stop_grace_seconds must be in [0, 3600]"},
      {[](LaunchOptions& o) { o.master_addr.clear(); }, "launch: master_addr is empty"},
  };
  for (const Case& c : cases) {
    LaunchOptions o;
    c.set(o);
    absl::StatusOr<int> r = launch_local({"/bin/sh", "-c", "exit 9"}, o);
    ASSERT_FALSE(r.ok()) << c.expected << ": launched, exit code " << *r;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr(c.expected));
    EXPECT_EQ(std::string(r.status().message()).find('\n'), std::string::npos) << r.status();
  }
}

}  // namespace
}  // namespace dtrain::comm
