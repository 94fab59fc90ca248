#include "launcher/process_set.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace dtrain::comm {
namespace {

struct Ran {
  std::vector<std::string> out, err;
};

// Runs the set to completion, collecting each process's stdout and stderr.
Ran run_to_end(ProcessSet& set) {
  Ran ran;
  ran.out.resize(set.size());
  ran.err.resize(set.size());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!set.done() && std::chrono::steady_clock::now() < deadline) {
    set.poll(std::chrono::milliseconds(200), [&](int i, Pipe p, const char* d, size_t n) {
      (p == Pipe::kOut ? ran.out : ran.err)[i].append(d, n);
    });
    set.reap();
  }
  EXPECT_TRUE(set.done()) << "processes still running after 20 s";
  return ran;
}

bool gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return true;
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return true;
  char state = '?';
  [[maybe_unused]] int n = std::fscanf(f, "%*d %*s %c", &state);
  std::fclose(f);
  return state == 'Z' || state == 'X';
}

bool gone_within(pid_t pid, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!gone(pid) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return gone(pid);
}

std::string tmp_dir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return tmp != nullptr ? tmp : "/tmp";
}

pid_t read_pid(const std::string& file) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    if (FILE* f = std::fopen(file.c_str(), "r"); f != nullptr) {
      int pid = 0;
      const int n = std::fscanf(f, "%d", &pid);
      std::fclose(f);
      if (n == 1 && pid > 0) return pid;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

TEST(ProcessSetTest, EnvironmentOutputAndExitCodes) {
  ::setenv("DTRAIN_PROCESS_SET_GONE", "x", 1);
  ProcessSet set;
  ProcessSpec split;
  split.argv = {"/bin/sh", "-c",
                "echo out=$A gone=${DTRAIN_PROCESS_SET_GONE:-none}; echo err >&2; exit 3"};
  split.env = {{"A", "1"}};
  split.unset_env = {"DTRAIN_PROCESS_SET_GONE"};
  ASSERT_TRUE(set.start(split).ok());
  ProcessSpec merged;
  merged.argv = {"sh", "-c", "echo one; echo two >&2; kill -TERM $$"};  // found on PATH
  merged.output = ProcessSpec::Output::kMerged;
  ASSERT_TRUE(set.start(merged).ok());
  ProcessSpec missing;
  missing.argv = {"/no/such/program"};
  missing.error_prefix = "test: ";
  ASSERT_TRUE(set.start(missing).ok());
  ::unsetenv("DTRAIN_PROCESS_SET_GONE");
  Ran ran = run_to_end(set);
  EXPECT_EQ(ran.out[0], "out=1 gone=none\n");
  EXPECT_EQ(ran.err[0], "err\n");
  EXPECT_EQ(set.exit_code(0), 3);
  EXPECT_EQ(set.term_signal(0), 0);
  EXPECT_EQ(ran.out[1], "one\ntwo\n");
  EXPECT_EQ(ran.err[1], "");
  EXPECT_EQ(set.exit_code(1), 128 + SIGTERM);
  EXPECT_EQ(set.term_signal(1), SIGTERM);
  EXPECT_EQ(set.exit_code(2), 127);
  EXPECT_EQ(ran.err[2].rfind("test: cannot start /no/such/program: ", 0), 0u) << ran.err[2];
}

// The destructor kills every process still running, with its process group (a grandchild too).
TEST(ProcessSetTest, DestructorLeavesNoOrphans) {
  const std::string file = tmp_dir() + "/grandchild.pid";
  std::remove(file.c_str());
  pid_t child = -1, grandchild = -1;
  {
    ProcessSet set;
    ProcessSpec spec;
    spec.argv = {"/bin/sh", "-c", "sleep 60 & echo $! > " + file + "; wait"};
    ASSERT_TRUE(set.start(spec).ok());
    child = set.pid(0);
    grandchild = read_pid(file);
  }
  EXPECT_TRUE(gone_within(child, std::chrono::seconds(5))) << "the child outlived its ProcessSet";
  ASSERT_GT(grandchild, 0);
  EXPECT_TRUE(gone_within(grandchild, std::chrono::seconds(5)))
      << "the grandchild outlived the ProcessSet";
  if (!gone(grandchild)) ::kill(grandchild, SIGKILL);
}

// A process whose parent is killed with SIGKILL (no destructor runs) dies too.
TEST(ProcessSetTest, ChildrenDieWithAKilledParent) {
  const std::string file = tmp_dir() + "/child.pid";
  std::remove(file.c_str());
  const pid_t parent = ::fork();
  ASSERT_GE(parent, 0);
  if (parent == 0) {
    ProcessSet set;
    ProcessSpec spec;
    spec.argv = {"/bin/sh", "-c", "echo $$ > " + file + "; exec sleep 60"};
    if (!set.start(spec).ok()) std::_Exit(1);
    while (true) ::pause();  // killed below
  }
  const pid_t child = read_pid(file);
  ::kill(parent, SIGKILL);
  ::waitpid(parent, nullptr, 0);
  ASSERT_GT(child, 0);
  EXPECT_TRUE(gone_within(child, std::chrono::seconds(5)))
      << "the child outlived its killed parent";
  if (!gone(child)) ::kill(child, SIGKILL);
}

TEST(ProcessSetTest, SignalAllAndKillAll) {
  ProcessSet set;
  ProcessSpec spec;
  spec.argv = {"/bin/sh", "-c",
               "trap 'echo got TERM; exit 7' TERM; echo ready; while true; do sleep 0.05; done"};
  ASSERT_TRUE(set.start(spec).ok());
  ASSERT_TRUE(set.start(spec).ok());
  std::vector<std::string> out(2);
  auto collect = [&](int i, Pipe, const char* d, size_t n) { out[i].append(d, n); };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((out[0].find("ready") == std::string::npos || out[1].find("ready") == std::string::npos) &&
         std::chrono::steady_clock::now() < deadline) {
    set.poll(std::chrono::milliseconds(100), collect);
  }
  EXPECT_EQ(set.num_running(), 2);
  set.signal_all(SIGTERM);
  while (!set.done() && std::chrono::steady_clock::now() < deadline) {
    set.poll(std::chrono::milliseconds(100), collect);
    set.reap();
  }
  ASSERT_TRUE(set.done());
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(set.exit_code(i), 7);
    EXPECT_NE(out[i].find("got TERM"), std::string::npos) << out[i];
  }
  set.kill_all();  // nothing left: a no-op
  EXPECT_EQ(set.exit_code(0), 7);
  EXPECT_NE(free_port(), 0);
}

int g_wake[2] = {-1, -1};
void write_wake(int sig) {
  const char c = static_cast<char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_wake[1], &c, 1);
}

// A signal sent to a child right after start must act on the child by default, never run this
// process's handler in the child: the launcher's handler writes to its wake-up pipe, which the
// child shares until exec, and the launcher once took its own SIGTERM to a rank for one sent to it.
TEST(ProcessSetTest, ASignalRightAfterStartNeverRunsTheParentsHandler) {
  ASSERT_EQ(::pipe(g_wake), 0);
  struct sigaction sa {
  }, old{};
  sa.sa_handler = write_wake;
  ::sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, &old);
  int killed_by_term = 0;
  for (int i = 0; i < 200; ++i) {
    ProcessSet set;
    ProcessSpec spec;
    spec.argv = {"/bin/sleep", "10"};
    ASSERT_TRUE(set.start(spec).ok());
    set.signal_all(SIGTERM);  // at once: the child may not have reached exec yet
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (!set.done() && std::chrono::steady_clock::now() < give_up) {
      set.poll(std::chrono::milliseconds(20), [](int, Pipe, const char*, size_t) {});
      for (int k : set.reap()) killed_by_term += set.exit_code(k) == 128 + SIGTERM ? 1 : 0;
    }
    if (!set.done()) break;  // the child survived its SIGTERM (the destructor kills it)
  }
  ::sigaction(SIGTERM, &old, nullptr);
  ::close(g_wake[1]);
  char c;
  int handled = 0;
  while (::read(g_wake[0], &c, 1) == 1) ++handled;
  ::close(g_wake[0]);
  EXPECT_EQ(handled, 0) << "the parent's SIGTERM handler ran (in a child) " << handled << " times";
  EXPECT_EQ(killed_by_term, 200) << "children that survived a SIGTERM sent right after start";
}

}  // namespace
}  // namespace dtrain::comm
