// Two nodes' launchers on this host (--nnodes=2 --max_restarts=1) and strangers calling on node 0's
// port (issue 39): each is answered with one line, reported on node 0's stderr and forgotten; the
// real nodes run on, restart together and end with 0.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "launcher/internal/line_conn.h"
#include "launcher/launch_testing.h"
#include "launcher/process_set.h"

namespace {

using dtrain::comm::testing::Result;
using dtrain::comm::testing::run_launch;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
using namespace std::chrono_literals;

int occurrences(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + 1))
    ++n;
  return n;
}

// A fresh directory under the test's temporary directory.
std::string fresh_dir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
  EXPECT_EQ(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()), 0);
  return dir;
}

// Node k's launcher of two, one rank each, running `script` under /bin/sh.
std::vector<std::string> node_args(int k, int port, const std::vector<std::string>& flags,
                                   const std::string& script) {
  std::vector<std::string> args = {"--nnodes=2", "--node_rank=" + std::to_string(k),
                                   "--nproc_per_node=1", "--stop_grace_seconds=1",
                                   "--max_restarts=1", "--master_port=" + std::to_string(port),
                                   // a launcher that waits for a node that never comes fails
                                   "--join_timeout=60"};
  args.insert(args.end(), flags.begin(), flags.end());
  for (const char* a : {"--", "/bin/sh", "-c"}) args.push_back(a);
  args.push_back(script);
  return args;
}

// What `printf BYTES | nc 127.0.0.1 PORT` prints: connects (retrying while nothing listens yet),
// sends `bytes`, and returns all the peer answers until it ends the connection.
std::string nc(int port, const std::string& bytes) {
  absl::StatusOr<int> fd = absl::UnavailableError("not tried");
  for (int i = 0; i < 1500 && !fd.ok(); ++i) {
    fd = dtrain::comm::internal::connect_to("127.0.0.1", port);
    if (!fd.ok()) std::this_thread::sleep_for(20ms);
  }
  if (!fd.ok()) {
    ADD_FAILURE() << fd.status();
    return "";
  }
  ::fcntl(*fd, F_SETFL, 0);
  timeval tv{60, 0};  // a launcher that never answers fails the test instead of hanging it
  ::setsockopt(*fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  EXPECT_EQ(::write(*fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(*fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
  ::close(*fd);
  return out;
}

// Waits for a file a rank writes; false after 120 s (the rank never started).
bool wait_for_file(const std::string& path) {
  for (int i = 0; i < 6000; ++i, std::this_thread::sleep_for(20ms)) {
    if (::access(path.c_str(), F_OK) == 0) return true;
  }
  return false;
}

// The case: mid-run, a stranger says node 1's HELLO without a run id and READY. Before,
// node 0 took it for node 1, restarted every rank with it and the real node 1 exited 1. Now it,
// a second HELLO for the live node 1 (with the right run id) and HELLOs that do not fit are
// refused; then the real rank 1 fails, and both nodes restart together and succeed.
TEST(LaunchStrangerTest, StrangersMidRunAreRefusedAndTheNodesRunOn) {
  const std::string dir = fresh_dir("mid_run");
  const int port = dtrain::comm::free_port();
  const std::string script =
      "echo attempt=$TORCHELASTIC_RESTART_COUNT; if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then "
      "touch " +
      dir + "/up.$RANK; while [ ! -e " + dir +
      "/go ]; do sleep 0.05; done; "
      "if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 60; fi";
  std::vector<Result> r(2);
  std::vector<std::thread> nodes;
  for (int k = 0; k < 2; ++k)
    nodes.emplace_back([&, k] { r[k] = run_launch(node_args(k, port, {}, script)); });
  const bool up = wait_for_file(dir + "/up.0") && wait_for_file(dir + "/up.1");
  EXPECT_TRUE(up) << "the ranks of attempt 0 never started";
  std::vector<std::string> replies;
  if (up) {
    for (const char* bytes : {"HELLO 1 1 2 1\nREADY 1\n", "HELLO 1 1 2 1 none\nREADY 1\n",
                              "HELLO 1 3 2 1\n", "HELLO 1 1 3 1 none\n"}) {
      replies.push_back(nc(port, bytes));
    }
  }
  EXPECT_EQ(std::system(("touch " + dir + "/go").c_str()), 0);
  for (std::thread& t : nodes) t.join();

  ASSERT_EQ(replies.size(), 4u);
  EXPECT_THAT(replies[0], StartsWith("ERROR node 1's HELLO carries no run id"));
  EXPECT_THAT(replies[1], StartsWith("BUSY node 1's launcher is connected and alive"));
  EXPECT_THAT(replies[2], StartsWith("ERROR node 1's HELLO carries no run id"));
  EXPECT_THAT(replies[3], StartsWith("ERROR node 1 has nproc_per_node 1, nnodes 3, max_restarts"));
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(r[k].code, 0) << "node " << k << ": " << r[k].output;
    EXPECT_THAT(r[k].output, HasSubstr("attempt=1")) << "node " << k;
    EXPECT_EQ(occurrences(r[k].output, "restarting all ranks"), 1) << r[k].output;
  }
  EXPECT_THAT(r[0].output, HasSubstr("launch: rank 1 (node 1) exited with code 3; stopping this "
                                     "node's ranks; restarting all ranks (attempt 2 of 2)"));
  EXPECT_EQ(occurrences(r[0].output, "launch: node 0 refused a connection from 127.0.0.1:"), 4)
      << r[0].output;
  EXPECT_THAT(r[0].output, HasSubstr(": node 1's HELLO carries no run id (\"HELLO 1 1 2 1\")"));
  EXPECT_THAT(r[0].output, HasSubstr("; the job goes on\n"));
  EXPECT_THAT(r[1].output, Not(HasSubstr("refused")));
}

// Strangers before node 1's launcher joins (the "HELLO 1 3 2 1", another job's run id):
// before, node 0 exited 2 at once blaming node 1. Now node 0 answers them, waits on, and runs the
// job with the real node 1; both ranks get the --rdzv_id both launchers were given.
TEST(LaunchStrangerTest, NodeZeroWaitsPastStrangersForTheRealNode) {
  const int port = dtrain::comm::free_port();
  const std::vector<std::string> flags = {"--rdzv_id=job-42"};
  const std::string script = "echo id=$TORCHELASTIC_RUN_ID";
  Result node0;
  std::thread first([&] { node0 = run_launch(node_args(0, port, flags, script)); });
  std::vector<std::string> replies;
  for (const char* bytes : {"HELLO 1 3 2 1\n", "HELLO 1 1 2 1 none\n", "HELLO 1 1 2 1 job-43\n"})
    replies.push_back(nc(port, bytes));
  const Result node1 = run_launch(node_args(1, port, flags, script));
  first.join();
  ASSERT_EQ(replies.size(), 3u);
  EXPECT_THAT(replies[0], StartsWith("ERROR node 1's HELLO carries no run id"));
  EXPECT_EQ(replies[1],
            "ERROR node 1's --rdzv_id \"none\" is not this job's; give every node's launcher the "
            "same --rdzv_id\n");
  EXPECT_THAT(replies[2], StartsWith("ERROR node 1's --rdzv_id \"job-43\" is not this job's"));
  EXPECT_EQ(node0.code, 0) << node0.output;
  EXPECT_EQ(node1.code, 0) << node1.output;
  EXPECT_THAT(node0.output, HasSubstr("[rank 0] id=job-42\n"));
  EXPECT_THAT(node1.output, HasSubstr("[rank 1] id=job-42\n"));
  EXPECT_EQ(occurrences(node0.output, "launch: node 0 refused a connection"), 3) << node0.output;
}

// A node's launcher given another --rdzv_id is refused and exits 2 naming the difference; node 0
// waits on, and runs the job once node 1's launcher is started again with the job's id.
TEST(LaunchStrangerTest, ANodeWithAnotherRdzvIdIsRefusedAndNodeZeroWaitsOn) {
  const int port = dtrain::comm::free_port();
  Result node0;
  std::thread first([&] { node0 = run_launch(node_args(0, port, {"--rdzv_id=job-a"}, "true")); });
  const Result wrong = run_launch(node_args(1, port, {"--rdzv_id=job-b"}, "true"));
  const Result right = run_launch(node_args(1, port, {"--rdzv_id=job-a"}, "true"));
  first.join();
  EXPECT_EQ(wrong.code, 2) << wrong.output;
  EXPECT_EQ(wrong.output,
            "launch: node 0 refused this node: node 1's --rdzv_id \"job-b\" is not this job's; "
            "give every node's launcher the same --rdzv_id\n");
  EXPECT_EQ(right.code, 0) << right.output;
  EXPECT_EQ(node0.code, 0) << node0.output;
  EXPECT_THAT(node0.output, HasSubstr(": node 1's --rdzv_id \"job-b\" is not this job's"));
}

}  // namespace
