// Runs //launcher:launch as a user would, for the launcher's tests (the binary from the test's
// runfiles: list ":launch" in the test's data).
#ifndef DTRAIN_LAUNCHER_LAUNCH_TESTING_H_
#define DTRAIN_LAUNCHER_LAUNCH_TESTING_H_

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace dtrain::comm::testing {

struct Result {
  int code = -1;
  std::string output;
  double seconds = 0;
};

// Runs `launcher/launch ARGS...` (from the test's runfiles), output merged; optionally sends `sig` to
// the launcher after `signal_after`.
inline Result run_launch(std::vector<std::string> args, int sig = 0,
                         std::chrono::milliseconds signal_after = std::chrono::milliseconds(0)) {
  args.insert(args.begin(), "launcher/launch");
  int fds[2];
  // Close-on-exec: a launch started at the same time from another thread must not inherit this
  // pipe's write end (its launcher would hold this launch's output open, and its end, until it
  // exits). dup2 below clears the flag on the child's stdout and stderr.
  EXPECT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    ::close(fds[1]);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    std::_Exit(127);
  }
  ::close(fds[1]);
  std::thread signaller;
  if (sig != 0) {
    signaller = std::thread([=] {
      std::this_thread::sleep_for(signal_after);
      ::kill(pid, sig);
    });
  }
  Result r;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof(buf))) > 0;) r.output.append(buf, n);
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (signaller.joinable()) signaller.join();
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

}  // namespace dtrain::comm::testing

#endif  // DTRAIN_LAUNCHER_LAUNCH_TESTING_H_
