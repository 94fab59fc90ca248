#include "comm/local_launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dtrain::comm {
namespace {

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const char c = static_cast<char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &c, 1);
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 29500;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

// A relative program path that is not there from the current directory is tried from the
// directory `bazel run` was started in (BUILD_WORKING_DIRECTORY).
std::string resolve_program(const std::string& program) {
  if (program.find('/') == std::string::npos || program[0] == '/') return program;
  struct stat st;
  if (::stat(program.c_str(), &st) == 0) return program;
  if (const char* wd = std::getenv("BUILD_WORKING_DIRECTORY"); wd != nullptr) {
    std::string candidate = absl::StrCat(wd, "/", program);
    if (::stat(candidate.c_str(), &st) == 0) return candidate;
  }
  return program;
}

struct Stream {
  int fd = -1;
  FILE* sink = nullptr;
  std::string partial;
};

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  Stream out, err;
  bool running = true;
  int code = 0;
};

void emit(Rank& r, Stream& s, const char* data, size_t n) {
  s.partial.append(data, n);
  size_t start = 0;
  for (size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    std::fprintf(s.sink, "[rank %d] %.*s\n", r.rank, static_cast<int>(nl - start), s.partial.data() + start);
  }
  s.partial.erase(0, start);
  std::fflush(s.sink);
}

void flush_partial(Rank& r, Stream& s) {
  if (!s.partial.empty()) {
    std::fprintf(s.sink, "[rank %d] %s\n", r.rank, s.partial.c_str());
    s.partial.clear();
    std::fflush(s.sink);
  }
}

void signal_all(std::vector<Rank>& ranks, int sig) {
  for (auto& r : ranks) {
    if (r.running && r.pid > 0) ::kill(-r.pid, sig);  // the rank's whole process group
  }
}

// After a failed spawn: the ranks already started must not train on without their peers.
absl::Status stop_started(std::vector<Rank>& ranks, const std::string& what) {
  signal_all(ranks, SIGKILL);
  for (auto& r : ranks) {
    if (r.running && r.pid > 0) ::waitpid(r.pid, nullptr, 0);
    r.running = false;
    for (Stream* s : {&r.out, &r.err}) {
      if (s->fd >= 0) ::close(s->fd);
      s->fd = -1;
    }
  }
  return absl::InternalError(absl::StrCat("launch: ", what, ": ", std::strerror(errno),
                                          "; the ranks already started were stopped"));
}

}  // namespace

absl::StatusOr<int> launch_local(const std::vector<std::string>& argv, const LaunchOptions& options) {
  const int nproc = options.nproc_per_node;
  const int nnodes = options.nnodes;
  const int node_rank = options.node_rank;
  if (argv.empty() || argv[0].empty()) return absl::InvalidArgumentError("launch: no program given");
  if (nproc < 1 || nnodes < 1 || node_rank < 0 || node_rank >= nnodes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "launch: need nproc_per_node >= 1, nnodes >= 1 and 0 <= node_rank < nnodes (got ", nproc, ", ", nnodes, ", ",
        node_rank, ")"));
  }
  if (nproc > kMaxProcsPerNode) {
    return absl::InvalidArgumentError(absl::StrCat("launch: nproc_per_node ", nproc, " exceeds the limit of ",
                                                   kMaxProcsPerNode, " ranks per node; use more nodes"));
  }
  int port = options.master_port;
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("launch: master_port ", port, " is not a port number (0-65535)"));
  }
  if (port == 0) port = nnodes == 1 ? free_port() : 29500;
  const std::string program = resolve_program(argv[0]);
  std::vector<std::string> args = argv;
  args[0] = program;
  std::vector<char*> child_argv;
  for (auto& a : args) child_argv.push_back(const_cast<char*>(a.c_str()));
  child_argv.push_back(nullptr);
  const int grace_ms = static_cast<int>(1000 * options.stop_grace_seconds);

  if (::pipe(g_signal_pipe) != 0) return absl::InternalError(absl::StrCat("launch: pipe: ", std::strerror(errno)));
  ::fcntl(g_signal_pipe[0], F_SETFD, FD_CLOEXEC);
  ::fcntl(g_signal_pipe[1], F_SETFD, FD_CLOEXEC);
  ::fcntl(g_signal_pipe[1], F_SETFL, O_NONBLOCK);
  // The caller's handlers come back, and the pipe is closed, however this function returns.
  struct SignalsInstalled {
    const int signals[4] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};
    struct sigaction old[4] {};
    SignalsInstalled() {
      struct sigaction sa {};
      sa.sa_handler = on_signal;
      ::sigemptyset(&sa.sa_mask);
      for (int i = 0; i < 4; ++i) ::sigaction(signals[i], &sa, &old[i]);
    }
    ~SignalsInstalled() {
      for (int i = 0; i < 4; ++i) ::sigaction(signals[i], &old[i], nullptr);
      ::close(g_signal_pipe[0]);
      ::close(g_signal_pipe[1]);
      g_signal_pipe[0] = g_signal_pipe[1] = -1;
    }
  } installed;

  const int world = nproc * nnodes;
  // One thread per rank is what 2-core machines can afford; torchrun does the same.
  const bool set_omp = options.one_thread_per_rank && std::getenv("OMP_NUM_THREADS") == nullptr && nproc > 1;
  std::vector<Rank> ranks(nproc);
  for (int local = 0; local < nproc; ++local) {
    Rank& r = ranks[local];
    r.rank = node_rank * nproc + local;
    int out[2] = {-1, -1}, err[2] = {-1, -1};
    if (::pipe(out) != 0 || ::pipe(err) != 0) {
      for (int fd : {out[0], out[1], err[0], err[1]}) {
        if (fd >= 0) ::close(fd);
      }
      return stop_started(ranks, "pipe");
    }
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (int fd : {out[0], out[1], err[0], err[1]}) ::close(fd);
      return stop_started(ranks, "fork");
    }
    if (pid == 0) {
      // A rank dies with its launcher (kill -9 included), as torchrun's workers do; the check
      // after prctl covers a launcher that died before it.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) std::_Exit(128 + SIGKILL);
      ::setpgid(0, 0);
      if (!(options.rank0_owns_terminal && local == 0)) {
        ::dup2(out[1], 1);
        ::dup2(err[1], 2);
      }
      ::close(out[0]); ::close(out[1]); ::close(err[0]); ::close(err[1]);
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) ::sigaction(sig, &dfl, nullptr);
      ::setenv("RANK", std::to_string(r.rank).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("GROUP_RANK", std::to_string(node_rank).c_str(), 1);
      ::setenv("MASTER_ADDR", options.master_addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      if (set_omp) ::setenv("OMP_NUM_THREADS", "1", 1);
      ::execvp(child_argv[0], child_argv.data());
      std::fprintf(stderr, "launch: cannot start %s: %s\n", child_argv[0], std::strerror(errno));
      std::_Exit(127);
    }
    ::setpgid(pid, pid);
    ::close(out[1]);
    ::close(err[1]);
    r.pid = pid;
    r.out = Stream{out[0], stdout, {}};
    r.err = Stream{err[0], stderr, {}};
    if (options.rank0_owns_terminal && local == 0) {
      ::close(out[0]);
      ::close(err[0]);
      r.out.fd = r.err.fd = -1;
    }
  }

  int exit_code = 0;
  bool stopping = false;
  std::chrono::steady_clock::time_point kill_at{};
  int running = nproc;
  while (running > 0 || std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.out.fd >= 0 || r.err.fd >= 0; })) {
    std::vector<pollfd> pfds = {{g_signal_pipe[0], POLLIN, 0}};
    std::vector<std::pair<Rank*, Stream*>> who = {{nullptr, nullptr}};
    for (auto& r : ranks) {
      for (Stream* s : {&r.out, &r.err}) {
        if (s->fd >= 0) {
          pfds.push_back({s->fd, POLLIN, 0});
          who.emplace_back(&r, s);
        }
      }
    }
    ::poll(pfds.data(), pfds.size(), 200);
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      char buf[8192];
      const ssize_t n = ::read(pfds[i].fd, buf, sizeof(buf));
      if (i == 0) {
        for (ssize_t k = 0; k < n; ++k) {
          const int sig = buf[k];
          if (sig == SIGCHLD) continue;
          // Forward the first signal; the ranks decide how to stop. A second one is escalated.
          if (!stopping) {
            std::fprintf(stderr, "launch: got signal %d, forwarding to the ranks\n", sig);
            signal_all(ranks, sig);
            stopping = true;
            if (exit_code == 0) exit_code = 128 + sig;
            kill_at = std::chrono::steady_clock::now() +
                      std::chrono::milliseconds(grace_ms);
          } else {
            signal_all(ranks, SIGKILL);
          }
        }
        continue;
      }
      auto [r, s] = who[i];
      if (n > 0) {
        emit(*r, *s, buf, static_cast<size_t>(n));
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        flush_partial(*r, *s);
        ::close(s->fd);
        s->fd = -1;
      }
    }
    for (auto& r : ranks) {
      if (!r.running) continue;
      int status = 0;
      if (::waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
      r.running = false;
      --running;
      r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (r.code != 0 && !stopping) {
        std::fprintf(stderr, "launch: rank %d exited with code %d; stopping the other ranks\n", r.rank, r.code);
        exit_code = r.code;
        stopping = true;
        signal_all(ranks, SIGTERM);
        kill_at = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(grace_ms);
      }
    }
    if (stopping && running > 0 && std::chrono::steady_clock::now() >= kill_at) {
      signal_all(ranks, SIGKILL);
      kill_at = std::chrono::steady_clock::now() + std::chrono::hours(1);
    }
  }
  return exit_code;
}

}  // namespace dtrain::comm
