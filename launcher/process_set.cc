#include "launcher/process_set.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace dtrain::comm {
namespace {

// The child's environment, built before fork: between fork and exec only async-signal-safe calls
// are allowed (the parent may have other threads), so no setenv there.
std::vector<std::string> child_environment(const ProcessSpec& spec) {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq != nullptr) env[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
  }
  for (const auto& [k, v] : spec.env) env[k] = v;
  for (const auto& k : spec.unset_env) env.erase(k);
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(absl::StrCat(k, "=", v));
  return out;
}

void write_all(int fd, const std::string& s) {
  for (size_t done = 0; done < s.size();) {
    const ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

}  // namespace

int free_port(const std::string& addr) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* ai = nullptr;
  if (::getaddrinfo(addr.c_str(), "0", &hints, &ai) != 0 || ai == nullptr) {
    return kDefaultMasterPort;
  }
  int port = kDefaultMasterPort;
  const int fd = ::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  if (fd >= 0 && ::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
    port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                       : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(ai);
  return port;
}

ProcessSet::~ProcessSet() { kill_all(); }

void ProcessSet::record(Member& m, int status) {
  m.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  m.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + m.signal;
}

absl::Status ProcessSet::start(const ProcessSpec& spec) {
  if (spec.argv.empty()) return absl::InvalidArgumentError("ProcessSet::start: empty argv");
  const std::vector<std::string> env = child_environment(spec);
  std::vector<char*> envp, argv;
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const std::string cannot_start =
      absl::StrCat(spec.error_prefix, "cannot start ", spec.argv[0], ": ");

  int out[2] = {-1, -1}, err[2] = {-1, -1};
  auto close_all = [&] {
    for (int fd : {out[0], out[1], err[0], err[1]}) {
      if (fd >= 0) ::close(fd);
    }
  };
  const bool piped = spec.output != ProcessSpec::Output::kInherit;
  const bool split = spec.output == ProcessSpec::Output::kPipes;
  if ((piped && ::pipe2(out, O_CLOEXEC) != 0) || (split && ::pipe2(err, O_CLOEXEC) != 0)) {
    const int e = errno;
    close_all();
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(e)));
  }
  const pid_t parent = ::getpid();
  // Signals stay blocked from before fork until the child has put their default actions back:
  // otherwise a signal_all right after start could reach the child while it still runs the
  // parent's handlers -- the launcher's writes the signal into the launcher's own wake-up pipe,
  // so the launcher took its own SIGTERM to a rank for one sent to it (and stopped restarting).
  sigset_t all, old;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &old);
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int e = errno;
    ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
    close_all();
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(e)));
  }
  if (pid == 0) {
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) ::sigaction(sig, &dfl, nullptr);
    ::pthread_sigmask(SIG_SETMASK, &old,
                      nullptr);  // a signal that came meanwhile acts now, by default
    // Dies with its parent (kill -9 included); the check after prctl covers a parent that died
    // before it.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(128 + SIGKILL);
    ::setpgid(0, 0);
    if (piped) {
      ::dup2(out[1], 1);
      ::dup2(split ? err[1] : out[1], 2);  // dup2 clears O_CLOEXEC on the copies
    }
    ::execvpe(argv[0], argv.data(), envp.data());
    const char* why = std::strerror(errno);
    write_all(2, cannot_start);
    write_all(2, why);
    write_all(2, "\n");
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here: no race with a signal_all right after start
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  Member m;
  m.pid = pid;
  if (piped) {
    ::close(out[1]);
    m.fds[0] = out[0];
  }
  if (split) {
    ::close(err[1]);
    m.fds[1] = err[0];
  }
  members_.push_back(m);
  return absl::OkStatus();
}

bool ProcessSet::poll(std::chrono::milliseconds timeout, const OutputFn& on_output, int wake_fd) {
  std::vector<pollfd> pfds;
  std::vector<std::pair<int, int>> who;  // (member, pipe) per pollfd; (-1, -1) for wake_fd
  if (wake_fd >= 0) {
    pfds.push_back({wake_fd, POLLIN, 0});
    who.emplace_back(-1, -1);
  }
  for (int i = 0; i < size(); ++i) {
    for (int p = 0; p < 2; ++p) {
      if (members_[i].fds[p] >= 0) {
        pfds.push_back({members_[i].fds[p], POLLIN, 0});
        who.emplace_back(i, p);
      }
    }
  }
  int64_t ms = std::max<int64_t>(0, timeout.count());
  // Exits wake nothing here: with no pipe left to watch, come back soon to let reap() see them.
  if (wake_fd < 0 && pfds.empty() && num_running() > 0) ms = std::min<int64_t>(ms, 20);
  if (::poll(pfds.data(), pfds.size(), static_cast<int>(ms)) <= 0) return false;
  bool woken = false;
  for (size_t k = 0; k < pfds.size(); ++k) {
    if (pfds[k].revents == 0) continue;
    auto [i, p] = who[k];
    if (i < 0) {
      woken = true;
      continue;
    }
    char buf[8192];
    const ssize_t n = ::read(pfds[k].fd, buf, sizeof(buf));
    if (n > 0) {
      on_output(i, static_cast<Pipe>(p), buf, static_cast<size_t>(n));
    } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
      ::close(members_[i].fds[p]);
      members_[i].fds[p] = -1;
      on_output(i, static_cast<Pipe>(p), buf, 0);
    }
  }
  return woken;
}

std::vector<int> ProcessSet::reap() {
  std::vector<int> exited;
  for (int i = 0; i < size(); ++i) {
    Member& m = members_[i];
    if (!m.running) continue;
    int status = 0;
    if (::waitpid(m.pid, &status, WNOHANG) != m.pid) continue;
    m.running = false;
    record(m, status);
    exited.push_back(i);
  }
  return exited;
}

int ProcessSet::num_running() const {
  int n = 0;
  for (const Member& m : members_) n += m.running ? 1 : 0;
  return n;
}

bool ProcessSet::done() const {
  for (const Member& m : members_) {
    if (m.running || m.fds[0] >= 0 || m.fds[1] >= 0) return false;
  }
  return true;
}

void ProcessSet::signal_all(int sig) {
  for (const Member& m : members_) {
    if (m.running && m.pid > 0) ::kill(-m.pid, sig);  // the process's whole group
  }
}

void ProcessSet::kill_all() {
  signal_all(SIGKILL);
  for (Member& m : members_) {
    if (m.running && m.pid > 0) {
      int status = 0;
      if (::waitpid(m.pid, &status, 0) == m.pid) record(m, status);
    }
    m.running = false;
    for (int& fd : m.fds) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  }
}

}  // namespace dtrain::comm
