// Runs the launch binary as a user would and checks its contract.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "launcher/launch_testing.h"
#include "launcher/process_set.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using dtrain::comm::testing::Result;
using dtrain::comm::testing::run_launch;

TEST(LaunchTest, SetsTorchrunEnvironmentAndPrefixesLines) {
  Result r =
      run_launch({"--nproc_per_node=2", "--", "/bin/sh", "-c",
                  "echo rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE lws=$LOCAL_WORLD_SIZE "
                  "addr=$MASTER_ADDR port=$MASTER_PORT; echo err >&2"});
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[rank 0] rank=0 local=0 world=2 lws=2 addr=127.0.0.1 port="));
  EXPECT_THAT(r.output, HasSubstr("[rank 1] rank=1 local=1 world=2 lws=2 addr=127.0.0.1 port="));
  EXPECT_THAT(r.output, HasSubstr("[rank 1] err"));
}

TEST(LaunchTest, MultiNodeRanksAreOffsetByNodeRank) {
  Result r =
      run_launch({"--nproc_per_node=2", "--nnodes=3", "--node_rank=2", "--master_port=29999", "--",
                  "/bin/sh", "-c", "echo rank=$RANK world=$WORLD_SIZE port=$MASTER_PORT"});
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[rank 4] rank=4 world=6 port=29999"));
  EXPECT_THAT(r.output, HasSubstr("[rank 5] rank=5 world=6 port=29999"));
}

TEST(LaunchTest, FailingRankStopsTheOthersAndSetsExitCode) {
  Result r = run_launch({"--nproc_per_node=3", "--", "/bin/sh", "-c",
                         "if [ \"$RANK\" = 1 ]; then echo failing; exit 3; fi; sleep 60"});
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_LT(r.seconds, 20) << "the sleeping ranks were not stopped";
  EXPECT_THAT(r.output, HasSubstr("launch: rank 1 exited with code 3; stopping the other ranks"));
}

TEST(LaunchTest, ForwardsSignals) {
  Result r =
      run_launch({"--nproc_per_node=2", "--", "/bin/sh", "-c",
                  "trap 'echo got TERM; exit 7' TERM; echo ready; while true; do sleep 0.1; done"},
                 SIGTERM, std::chrono::milliseconds(1500));
  EXPECT_THAT(r.output, HasSubstr("[rank 0] got TERM"));
  EXPECT_THAT(r.output, HasSubstr("[rank 1] got TERM"));
  EXPECT_NE(r.code, 0);
  EXPECT_LT(r.seconds, 20);
}

int count(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + 1))
    ++n;
  return n;
}

// --max_restarts: rank 1 fails on the first attempt only; the whole set is started again, on a
// fresh port, with TORCHELASTIC_RESTART_COUNT=1, and the job succeeds.
TEST(LaunchTest, RestartsAllRanksAfterAFailure) {
  Result r = run_launch(
      {"--nproc_per_node=2", "--max_restarts=1", "--", "/bin/sh", "-c",
       "echo attempt=$TORCHELASTIC_RESTART_COUNT of=$TORCHELASTIC_MAX_RESTARTS port=$MASTER_PORT; "
       "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then "
       "  if [ \"$RANK\" = 1 ]; then sleep 0.5; exit 3; fi; exec sleep 60; fi"});
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_LT(r.seconds, 20) << "the sleeping rank was not stopped before the restart";
  EXPECT_THAT(
      r.output,
      HasSubstr("launch: rank 1 exited with code 3; restarting all ranks (attempt 2 of 2)\n"));
  EXPECT_EQ(count(r.output, "restarting all ranks"), 1) << r.output;
  for (const char* rank : {"[rank 0] ", "[rank 1] "}) {
    EXPECT_THAT(r.output, HasSubstr(std::string(rank) + "attempt=0 of=1 port="));
    EXPECT_THAT(r.output, HasSubstr(std::string(rank) + "attempt=1 of=1 port="));
  }
  const size_t first = r.output.find("attempt=0 of=1 port="),
               second = r.output.find("attempt=1 of=1 port=");
  ASSERT_NE(first, std::string::npos);
  ASSERT_NE(second, std::string::npos);
  const std::string port0 = r.output.substr(first + 20, r.output.find('\n', first) - first - 20);
  const std::string port1 = r.output.substr(second + 20, r.output.find('\n', second) - second - 20);
  EXPECT_NE(port0, port1) << "a restart must not reuse the launcher-picked MASTER_PORT";
}

// A rank that fails every time: max_restarts + 1 attempts, then that rank's exit code.
TEST(LaunchTest, GivesUpAfterMaxRestarts) {
  Result r = run_launch({"--nproc_per_node=2", "--max_restarts=2", "--", "/bin/sh", "-c",
                         "echo attempt=$TORCHELASTIC_RESTART_COUNT; if [ \"$RANK\" = 1 ]; then "
                         "exit 5; fi; exec sleep 60"});
  EXPECT_EQ(r.code, 5) << r.output;
  EXPECT_LT(r.seconds, 30);
  EXPECT_THAT(
      r.output,
      HasSubstr("launch: rank 1 exited with code 5; restarting all ranks (attempt 2 of 3)\n"));
  EXPECT_THAT(
      r.output,
      HasSubstr("launch: rank 1 exited with code 5; restarting all ranks (attempt 3 of 3)\n"));
  EXPECT_THAT(
      r.output,
      HasSubstr("launch: rank 1 exited with code 5; stopping the other ranks; no restarts left"));
  EXPECT_EQ(count(r.output, "restarting all ranks"), 2) << r.output;
  EXPECT_EQ(count(r.output, "[rank 1] attempt="), 3) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[rank 1] attempt=2"));
  EXPECT_THAT(r.output, Not(HasSubstr("attempt=3")));
}

// A signal to the launcher stops the job even with restarts left.
// Two nodes' launchers on this host, as on two machines (--nnodes=2, one rank each).
std::vector<Result> run_two_nodes(const std::vector<std::string>& flags,
                                  const std::string& script) {
  const int port = dtrain::comm::free_port();  // for node 0's launcher
  std::vector<Result> out(2);
  std::vector<std::thread> nodes;
  for (int k = 0; k < 2; ++k) {
    nodes.emplace_back([&, k] {
      std::vector<std::string> args = {"--nnodes=2", "--node_rank=" + std::to_string(k),
                                       "--nproc_per_node=1", "--stop_grace_seconds=1",
                                       "--master_port=" + std::to_string(port)};
      args.insert(args.end(), flags.begin(), flags.end());
      for (const char* a : {"--", "/bin/sh", "-c"}) args.push_back(a);
      args.push_back(script);
      out[k] = run_launch(args);
    });
  }
  for (std::thread& t : nodes) t.join();
  return out;
}

// --max_restarts across nodes: rank 1 (node 1) fails in the first attempt; node 0's rank, still
// running, is stopped; both nodes start attempt 1 with node 0's port and run id, and succeed.
TEST(LaunchTest, NodesRestartTogether) {
  const std::vector<Result> r = run_two_nodes(
      {"--max_restarts=1"},
      "echo attempt=$TORCHELASTIC_RESTART_COUNT port=$MASTER_PORT id=$TORCHELASTIC_RUN_ID; "
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then "
      "  if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60; fi");
  EXPECT_EQ(r[0].code, 0) << r[0].output;
  EXPECT_EQ(r[1].code, 0) << r[1].output;
  EXPECT_LT(r[0].seconds, 30) << "node 0's rank was not stopped";
  EXPECT_THAT(r[0].output, HasSubstr("launch: rank 1 (node 1) exited with code 3; stopping this "
                                     "node's ranks; restarting all ranks (attempt 2 of 2) on "
                                     "every node"));
  EXPECT_THAT(r[1].output, HasSubstr("launch: rank 1 exited with code 3; restarting all ranks "
                                     "(attempt 2 of 2) on every node"));
  // Attempt 1's line from each node: the same port and run id.
  auto attempt1 = [](const std::string& out, int rank) {
    const std::string tag = "[rank " + std::to_string(rank) + "] attempt=1 ";
    const size_t at = out.find(tag);
    return at == std::string::npos
               ? ""
               : out.substr(at + tag.size(), out.find('\n', at) - at - tag.size());
  };
  EXPECT_NE(attempt1(r[0].output, 0), "") << r[0].output;
  EXPECT_EQ(attempt1(r[0].output, 0), attempt1(r[1].output, 1));
}

// No restarts left: every node exits with the failing rank's code, not only the failing node.
TEST(LaunchTest, EveryNodeExitsWithTheFailingCodeWhenNoRestartsAreLeft) {
  const std::vector<Result> r =
      run_two_nodes({"--max_restarts=1"},
                    "echo attempt=$TORCHELASTIC_RESTART_COUNT; if [ \"$RANK\" = 1 ]; then exit 4; "
                    "fi; sleep 60");
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(r[k].code, 4) << "node " << k << ": " << r[k].output;
    EXPECT_THAT(r[k].output, HasSubstr("attempt=1"));
    EXPECT_THAT(r[k].output, HasSubstr("no restarts left (max_restarts 1) on every node"));
  }
}

TEST(LaunchTest, SignalsAreNeverRestarted) {
  Result r =
      run_launch({"--nproc_per_node=2", "--max_restarts=3", "--", "/bin/sh", "-c",
                  "trap 'echo got TERM; exit 7' TERM; echo attempt=$TORCHELASTIC_RESTART_COUNT; "
                  "while true; do sleep 0.1; done"},
                 SIGTERM, std::chrono::milliseconds(1500));
  EXPECT_EQ(r.code, 128 + SIGTERM) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[rank 0] got TERM"));
  EXPECT_THAT(r.output, Not(HasSubstr("restarting")));
  EXPECT_THAT(r.output, Not(HasSubstr("attempt=1")));
  EXPECT_LT(r.seconds, 20);
}

bool process_gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return true;
  // A zombie nobody has reaped yet is dead too.
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return true;
  char state = '?';
  [[maybe_unused]] int n = std::fscanf(f, "%*d %*s %c", &state);
  std::fclose(f);
  return state == 'Z' || state == 'X';
}

TEST(LaunchTest, RanksDieWithAKilledLauncher) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/orphans";
  ASSERT_EQ(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()), 0);
  Result r = run_launch({"--nproc_per_node=3", "--", "/bin/sh", "-c",
                         "echo $$ > " + dir + "/pid.$RANK; exec sleep 60"},
                        SIGKILL, std::chrono::milliseconds(1500));
  EXPECT_EQ(r.code, 128 + SIGKILL);
  for (int rank = 0; rank < 3; ++rank) {
    FILE* f = std::fopen((dir + "/pid." + std::to_string(rank)).c_str(), "r");
    ASSERT_NE(f, nullptr) << "rank " << rank << " never started";
    int pid = 0;
    ASSERT_EQ(std::fscanf(f, "%d", &pid), 1);
    std::fclose(f);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!process_gone(pid) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_TRUE(process_gone(pid))
        << "rank " << rank << " (pid " << pid << ") outlived its killed launcher";
    if (!process_gone(pid)) ::kill(pid, SIGKILL);
  }
}

TEST(LaunchTest, BadUsageIsAOneLineError) {
  Result r = run_launch({"--nproc_per_node=0", "--", "/bin/true"});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.output, HasSubstr("launch: --nproc_per_node must be in [1, 256], got 0"));
  Result none = run_launch({"--nproc_per_node=2"});
  EXPECT_EQ(none.code, 2);
  EXPECT_THAT(none.output, HasSubstr("no program given"));
  Result many = run_launch({"--nproc_per_node=100000", "--", "/bin/true"});
  EXPECT_EQ(many.code, 2);
  EXPECT_THAT(many.output,
              HasSubstr("--nproc_per_node must be in [1, 256], got 100000 (ranks on this node; "
                        "for more ranks use more nodes)"));
  Result missing = run_launch({"--nproc_per_node=1", "--", "/no/such/program"});
  EXPECT_EQ(missing.code, 127);
  EXPECT_THAT(missing.output, HasSubstr("cannot start /no/such/program"));
  for (const char* bad : {"--max_restarts=-1", "--max_restarts=101"}) {
    Result restarts = run_launch({"--nproc_per_node=1", bad, "--", "/bin/true"});
    EXPECT_EQ(restarts.code, 2) << bad;
    EXPECT_THAT(restarts.output, HasSubstr("launch: --max_restarts must be in [0, 100], got "))
        << bad;
    EXPECT_EQ(count(restarts.output, "\n"), 1) << bad << ": " << restarts.output;
  }
  for (const char* bad : {"--join_timeout=0", "--join_timeout=nan", "--join_timeout=1e9"}) {
    Result join = run_launch({"--nproc_per_node=1", bad, "--", "/bin/true"});
    EXPECT_EQ(join.code, 2) << bad;
    EXPECT_THAT(join.output, HasSubstr("launch: --join_timeout must be in (0, 86400], got "))
        << bad;
  }
  for (const std::string& bad : std::vector<std::string>{"a b", "x/y", std::string(129, 'a')}) {
    Result id = run_launch({"--nproc_per_node=1", "--rdzv_id=" + bad, "--", "/bin/true"});
    EXPECT_EQ(id.code, 2) << bad;
    EXPECT_THAT(id.output, HasSubstr("must be 1 to 128 characters from [A-Za-z0-9._-]")) << bad;
    EXPECT_EQ(count(id.output, "\n"), 1) << bad << ": " << id.output;
  }
}

// Every number is bounded and the world size is computed in 64 bits (issue 29): before, --nnodes=2147483647
// exported WORLD_SIZE=-2 and exited 0. Each bad value is one line naming the flag and its range, exit 2, and
// no rank starts.
TEST(LaunchTest, OutOfRangeNumbersAreOneLineErrorsAndStartNothing) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--nproc_per_node=2", "--nnodes=2147483647", "--node_rank=1"},
       "launch: --nnodes must be in [1, 1073741824], got 2147483647\n"},
      {{"--nproc_per_node=2", "--nnodes=1073741824", "--node_rank=1"},
       "launch: --nnodes x --nproc_per_node = 1073741824 x 2 = 2147483648 ranks, more than the "
       "1073741824"},
      {{"--nnodes=4294967298", "--node_rank=1"},
       "launch: --nnodes must be in [1, 1073741824], got 4294967298\n"},
      {{"--nnodes=0"}, "launch: --nnodes must be in [1, 1073741824], got 0\n"},
      {{"--nnodes=2", "--node_rank=2"},
       "launch: --node_rank must be in [0, 1], got 2 (this node's index, below --nnodes=2)\n"},
      {{"--node_rank=-1"}, "launch: --node_rank must be in [0, 0], got -1"},
      {{"--nproc_per_node=4294967297"},
       "launch: --nproc_per_node must be in [1, 256], got 4294967297"},
      {{"--nproc_per_node=-3"}, "launch: --nproc_per_node must be in [1, 256], got -3"},
      {{"--master_port=65536"}, "launch: --master_port must be in [0, 65535], got 65536"},
      {{"--master_port=-1"}, "launch: --master_port must be in [0, 65535], got -1"},
      {{"--master_port=4294967296"}, "launch: --master_port must be in [0, 65535], got 4294967296"},
      {{"--max_restarts=4294967297"},
       "launch: --max_restarts must be in [0, 100], got 4294967297\n"},
      {{"--stop_grace_seconds=-1"}, "launch: --stop_grace_seconds must be in [0, 3600], got -1\n"},
      {{"--stop_grace_seconds=1e300"},
       "launch: --stop_grace_seconds must be in [0, 3600], got 1e+300\n"},
      {{"--master_addr="}, "launch: --master_addr is empty"},
  };
  for (const auto& [flags, expected] : cases) {
    std::vector<std::string> args = flags;
    for (const char* a : {"--", "/bin/sh", "-c", "echo started world=$WORLD_SIZE rank=$RANK"})
      args.emplace_back(a);
    Result r = run_launch(args);
    const std::string what = ::testing::PrintToString(flags);
    EXPECT_EQ(r.code, 2) << what << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(expected)) << what;
    EXPECT_EQ(count(r.output, "\n"), 1) << what << ": " << r.output;
    EXPECT_THAT(r.output, Not(HasSubstr("started"))) << what << ": a rank started";
  }
  // The largest world that fits still launches, with the right numbers.
  Result big = run_launch({"--nproc_per_node=2", "--nnodes=536870912", "--node_rank=536870911",
                           "--master_port=29999", "--", "/bin/sh", "-c",
                           "echo world=$WORLD_SIZE rank=$RANK"});
  EXPECT_EQ(big.code, 0) << big.output;
  EXPECT_THAT(big.output, HasSubstr("[rank 1073741822] world=1073741824 rank=1073741822\n"));
  EXPECT_THAT(big.output, HasSubstr("[rank 1073741823] world=1073741824 rank=1073741823\n"));
}

// --rdzv_id reaches every rank, in every attempt, as TORCHELASTIC_RUN_ID; without it each launch
// draws its own id, the same for all its ranks.
TEST(LaunchTest, RdzvIdIsTheRunId) {
  // Rank 1 fails the first attempt a second after printing, so that rank 0 has printed too before
  // the launcher stops it (on a loaded machine it sometimes had not: 3 lines instead of 4).
  const char* script =
      "echo id=$TORCHELASTIC_RUN_ID; if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 "
      "]; then sleep 1; exit 3; fi";
  Result given = run_launch({"--nproc_per_node=2", "--max_restarts=1", "--rdzv_id=job-7.a_b", "--",
                             "/bin/sh", "-c", script});
  EXPECT_EQ(given.code, 0) << given.output;
  EXPECT_EQ(count(given.output, "] id=job-7.a_b\n"), 4) << given.output;  // 2 ranks x 2 attempts
  std::vector<std::string> drawn;
  for (int launch = 0; launch < 2; ++launch) {
    Result r =
        run_launch({"--nproc_per_node=2", "--", "/bin/sh", "-c", "echo id=$TORCHELASTIC_RUN_ID"});
    ASSERT_EQ(r.code, 0) << r.output;
    const size_t at = r.output.find("[rank 0] id=");
    ASSERT_NE(at, std::string::npos) << r.output;
    drawn.push_back(r.output.substr(at + 12, r.output.find('\n', at) - at - 12));
    EXPECT_FALSE(drawn.back().empty());
    EXPECT_THAT(r.output, HasSubstr("[rank 1] id=" + drawn.back() + "\n"));
  }
  EXPECT_NE(drawn[0], drawn[1]);
}

}  // namespace
