#include "comm/local_launcher.h"

#include <signal.h>

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

}  // namespace
}  // namespace dtrain::comm
