// torchrun-style local launcher:
//   launch --nproc_per_node=N [--master_addr=A] [--master_port=P] [--nnodes=K --node_rank=I]
//          -- PROGRAM ARGS...
// starts N copies of PROGRAM with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR and MASTER_PORT set, prefixes every output line with "[rank R] ", forwards
// SIGINT/SIGTERM/SIGHUP to the ranks, and when a rank exits non-zero stops the others and exits
// with that rank's code (128 + signal for a rank killed by a signal).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
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

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(int, nproc_per_node, 1, "Processes (ranks) to start on this node.");
ABSL_FLAG(int, nnodes, 1, "Number of nodes in the job.");
ABSL_FLAG(int, node_rank, 0, "This node's index in [0, nnodes).");
ABSL_FLAG(std::string, master_addr, "127.0.0.1", "Address of the node running rank 0.");
ABSL_FLAG(int, master_port, 0,
          "Port of rank 0's rendezvous store; 0 picks a free port (single node) or 29500.");
ABSL_FLAG(double, stop_grace_seconds, 5.0,
          "After a rank fails or a signal arrives, seconds to wait before SIGKILL.");

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
    if (r.running) ::kill(-r.pid, sig);  // the rank's whole process group
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "launch --nproc_per_node=N [--master_port=P] -- PROGRAM ARGS...\n"
      "Starts N ranks of PROGRAM with torchrun's environment variables.");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  const int nproc = absl::GetFlag(FLAGS_nproc_per_node);
  const int nnodes = absl::GetFlag(FLAGS_nnodes);
  const int node_rank = absl::GetFlag(FLAGS_node_rank);
  if (rest.size() < 2) {
    std::fprintf(stderr, "launch: no program given; usage: launch --nproc_per_node=N -- PROGRAM ARGS...\n");
    return 2;
  }
  if (nproc < 1 || nnodes < 1 || node_rank < 0 || node_rank >= nnodes) {
    std::fprintf(stderr,
                 "launch: need --nproc_per_node >= 1, --nnodes >= 1 and 0 <= --node_rank < --nnodes "
                 "(got %d, %d, %d)\n", nproc, nnodes, node_rank);
    return 2;
  }
  int port = absl::GetFlag(FLAGS_master_port);
  if (port < 0 || port > 65535) {
    std::fprintf(stderr, "launch: --master_port=%d is not a port number\n", port);
    return 2;
  }
  if (port == 0) port = nnodes == 1 ? free_port() : 29500;
  const std::string program = resolve_program(rest[1]);
  std::vector<char*> child_argv(rest.begin() + 1, rest.end());
  child_argv[0] = const_cast<char*>(program.c_str());
  child_argv.push_back(nullptr);

  if (::pipe(g_signal_pipe) != 0) {
    std::perror("launch: pipe");
    return 1;
  }
  ::fcntl(g_signal_pipe[0], F_SETFD, FD_CLOEXEC);
  ::fcntl(g_signal_pipe[1], F_SETFD, FD_CLOEXEC);
  ::fcntl(g_signal_pipe[1], F_SETFL, O_NONBLOCK);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  ::sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) ::sigaction(sig, &sa, nullptr);

  const int world = nproc * nnodes;
  // One thread per rank is what 2-core machines can afford; torchrun does the same.
  const bool set_omp = std::getenv("OMP_NUM_THREADS") == nullptr && nproc > 1;
  std::vector<Rank> ranks(nproc);
  for (int local = 0; local < nproc; ++local) {
    Rank& r = ranks[local];
    r.rank = node_rank * nproc + local;
    int out[2], err[2];
    if (::pipe(out) != 0 || ::pipe(err) != 0) {
      std::perror("launch: pipe");
      return 1;
    }
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("launch: fork");
      return 1;
    }
    if (pid == 0) {
      ::setpgid(0, 0);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      ::close(out[0]); ::close(out[1]); ::close(err[0]); ::close(err[1]);
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) ::sigaction(sig, &dfl, nullptr);
      ::setenv("RANK", std::to_string(r.rank).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("GROUP_RANK", std::to_string(node_rank).c_str(), 1);
      ::setenv("MASTER_ADDR", absl::GetFlag(FLAGS_master_addr).c_str(), 1);
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
                      std::chrono::milliseconds(static_cast<int64_t>(1000 * absl::GetFlag(FLAGS_stop_grace_seconds)));
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
                  std::chrono::milliseconds(static_cast<int64_t>(1000 * absl::GetFlag(FLAGS_stop_grace_seconds)));
      }
    }
    if (stopping && running > 0 && std::chrono::steady_clock::now() >= kill_at) {
      signal_all(ranks, SIGKILL);
      kill_at = std::chrono::steady_clock::now() + std::chrono::hours(1);
    }
  }
  return exit_code;
}
