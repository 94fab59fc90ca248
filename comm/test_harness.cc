#include "comm/test_harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "absl/strings/str_cat.h"

namespace dtrain::comm::testing {
namespace {

constexpr char kRankEnv[] = "DTRAIN_TEST_RANK";

std::string describe(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.what_without_backtrace();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

bool in_rank_process() { return std::getenv(kRankEnv) != nullptr; }

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return 29500;
  }
  const int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

void run_ranks_as_threads(int world_size, const RankFn& fn, const HarnessOptions& options) {
  ASSERT_GE(world_size, 1);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  std::vector<std::string> errors(world_size);
  std::vector<bool> done(world_size, false);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      std::string error;
      try {
        InitOptions o;
        o.backend = options.backend;
        o.rank = rank;
        o.world_size = world_size;
        o.store = store;
        o.timeout = options.timeout;
        o.gloo_hostname = "127.0.0.1";
        absl::StatusOr<Group> g = init_process_group(o);
        if (!g.ok()) {
          error = absl::StrCat("init_process_group: ", g.status().ToString());
        } else {
          fn(*g);
        }
      } catch (...) {
        error = describe(std::current_exception());
      }
      std::lock_guard<std::mutex> lock(mu);
      errors[rank] = error;
      done[rank] = true;
      ++finished;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    const bool all = cv.wait_for(lock, options.timeout + options.grace,
                                 [&] { return finished == world_size; });
    if (!all) {
      std::string hung;
      for (int r = 0; r < world_size; ++r) if (!done[r]) absl::StrAppend(&hung, hung.empty() ? "" : ", ", r);
      std::cerr << "FAILED: rank(s) " << hung << " still running "
                << (options.timeout + options.grace).count()
                << " ms after start (a hung collective?); ending the test process\n";
      for (int r = 0; r < world_size; ++r)
        if (done[r] && !errors[r].empty()) std::cerr << "rank " << r << ": " << errors[r] << "\n";
      std::cerr.flush();
      std::_Exit(1);
    }
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world_size; ++r) {
    if (!errors[r].empty()) ADD_FAILURE() << "rank " << r << ": " << errors[r];
  }
}

void run_ranks_as_processes(int world_size, const RankFn& fn, const HarnessOptions& options) {
  if (const char* child = std::getenv(kRankEnv); child != nullptr) {
    // Child: be rank RANK, then leave without running the rest of the test binary.
    int code = 0;
    try {
      InitOptions o;
      o.backend = options.backend;
      o.timeout = options.timeout;
      absl::StatusOr<Group> g = init_process_group(o);
      if (!g.ok()) {
        std::cerr << "init_process_group: " << g.status() << "\n";
        code = 1;
      } else {
        fn(*g);
        if (::testing::Test::HasFailure()) code = 1;
      }
    } catch (...) {
      std::cerr << describe(std::current_exception()) << "\n";
      code = 1;
    }
    std::cout.flush();
    std::cerr.flush();
    std::_Exit(code);
  }

  ASSERT_GE(world_size, 1);
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  ASSERT_NE(info, nullptr);
  const std::string filter =
      absl::StrCat("--gtest_filter=", info->test_suite_name(), ".", info->name());
  const std::string port = std::to_string(free_port());

  struct Child {
    pid_t pid = -1;
    int out = -1;
    std::string output;
    int status = 0;
    bool exited = false;
  };
  std::vector<Child> children(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::dup2(fds[1], 1);
      ::dup2(fds[1], 2);
      ::close(fds[0]);
      ::close(fds[1]);
      const std::string r = std::to_string(rank);
      const std::string w = std::to_string(world_size);
      ::setenv(kRankEnv, r.c_str(), 1);
      ::setenv("RANK", r.c_str(), 1);
      ::setenv("LOCAL_RANK", r.c_str(), 1);
      ::setenv("WORLD_SIZE", w.c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", w.c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      // Children of a test must not write the parent's XML report.
      ::unsetenv("XML_OUTPUT_FILE");
      ::unsetenv("GTEST_OUTPUT");
      ::execl("/proc/self/exe", "/proc/self/exe", filter.c_str(), "--gtest_brief=1",
              static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    ::close(fds[1]);
    children[rank].pid = pid;
    children[rank].out = fds[0];
  }

  const auto deadline = std::chrono::steady_clock::now() + options.timeout + options.grace;
  bool timed_out = false;
  int open = world_size;
  while (open > 0) {
    std::vector<pollfd> pfds;
    std::vector<int> who;
    for (int r = 0; r < world_size; ++r) {
      if (children[r].out >= 0) {
        pfds.push_back(pollfd{children[r].out, POLLIN, 0});
        who.push_back(r);
      }
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    const int n = ::poll(pfds.data(), pfds.size(), static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (n <= 0) continue;
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      char buf[4096];
      const ssize_t got = ::read(pfds[i].fd, buf, sizeof(buf));
      if (got > 0) {
        children[who[i]].output.append(buf, static_cast<size_t>(got));
      } else {
        ::close(pfds[i].fd);
        children[who[i]].out = -1;
        --open;
      }
    }
  }
  for (int r = 0; r < world_size; ++r) {
    if (timed_out) ::kill(children[r].pid, SIGKILL);
    ::waitpid(children[r].pid, &children[r].status, 0);
    if (children[r].out >= 0) ::close(children[r].out);
  }
  for (int r = 0; r < world_size; ++r) {
    const int st = children[r].status;
    if (timed_out) {
      ADD_FAILURE() << "rank " << r << " still running " << (options.timeout + options.grace).count()
                    << " ms after start (hung?); killed. Output:\n" << children[r].output;
    } else if (WIFSIGNALED(st)) {
      ADD_FAILURE() << "rank " << r << " died of signal " << WTERMSIG(st) << ". Output:\n"
                    << children[r].output;
    } else if (WEXITSTATUS(st) != 0) {
      ADD_FAILURE() << "rank " << r << " exited with code " << WEXITSTATUS(st) << ". Output:\n"
                    << children[r].output;
    }
  }
}

}  // namespace dtrain::comm::testing
