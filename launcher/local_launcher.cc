#include "launcher/local_launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "launcher/node_rendezvous.h"
#include "launcher/process_set.h"

namespace dtrain::comm {
namespace {

// master_port 0 on several nodes is kDefaultMasterPort (torchrun's): every node must know it in
// advance.
// rdzv_id "" on several nodes: the id their launchers meet under (torchrun's default --rdzv_id).
constexpr char kDefaultRdzvId[] = "none";
// Connections node 0 refuses that it reports on stderr; later ones are counted only.
constexpr int kRefusalsShown = 10;

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const char c = static_cast<char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &c, 1);
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

// Prefixes every line a rank writes with "[rank R] " (a last line without '\n' when its pipe ends).
struct Relay {
  int rank = 0;
  std::array<std::string, 2> partial;  // by Pipe

  void feed(Pipe pipe, const char* data, size_t n) {
    FILE* sink = pipe == Pipe::kOut ? stdout : stderr;
    std::string& s = partial[static_cast<int>(pipe)];
    std::fflush(sink);
    if (n == 0) {  // the end of the pipe
      if (!s.empty()) emit(sink, s);
      s.clear();
      return;
    }
    s.append(data, n);
    size_t start = 0;
    for (size_t nl; (nl = s.find('\n', start)) != std::string::npos; start = nl + 1) {
      emit(sink, std::string_view(s).substr(start, nl - start));
    }
    s.erase(0, start);
  }

  // One write(2) per line: a line up to PIPE_BUF is never interleaved with another process's
  // output on the same pipe (stdio may split it).
  void emit(FILE* sink, std::string_view line) const {
    std::string out = "[rank " + std::to_string(rank) + "] ";
    out.append(line).push_back('\n');
    for (size_t done = 0; done < out.size();) {
      const ssize_t w = ::write(fileno(sink), out.data() + done, out.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return;  // the reader is gone: nothing to relay to
      done += static_cast<size_t>(w);
    }
  }
};

// A port free a moment ago and different from `previous` (a restart gets a fresh store).
int fresh_port(int previous) {
  int port = free_port();
  for (int tries = 0; port == previous && tries < 10; ++tries) port = free_port();
  return port;
}

// The first signal (other than SIGCHLD) waiting in the signal pipe, or 0.
int pending_signal() {
  int found = 0;
  for (pollfd p{g_signal_pipe[0], POLLIN, 0}; ::poll(&p, 1, 0) > 0 && (p.revents & POLLIN) != 0;) {
    char buf[64];
    const ssize_t n = ::read(g_signal_pipe[0], buf, sizeof(buf));
    if (n <= 0) break;
    for (ssize_t k = 0; k < n; ++k) {
      if (found == 0 && buf[k] != SIGCHLD) found = buf[k];
    }
  }
  return found;
}

// What all attempts share.
struct Job {
  const LaunchOptions* options = nullptr;
  std::vector<std::string> argv;  // the program's
  int world = 0;
  bool set_omp = false;
  int grace_ms = 0;
  std::string run_id;  // TORCHELASTIC_RUN_ID: one per launch, the same in every attempt
};

// How one attempt ended.
struct Outcome {
  int code = 0;            // 0, the first failing rank's code, or 128 + the launcher's signal
  bool signalled = false;  // the launcher received SIGINT, SIGTERM or SIGHUP during the attempt
  int rank = -1;           // the first failing rank of this node
  bool stopped = false;    // stopped because another node's attempt failed
};

// Local rank `local`'s process: the program with torchrun's environment for this attempt.
ProcessSpec rank_spec(const Job& job, int local, int port, int attempt) {
  const LaunchOptions& options = *job.options;
  const int nproc = options.nproc_per_node;
  ProcessSpec spec;
  spec.argv = job.argv;
  spec.env = {{"RANK", std::to_string(options.node_rank * nproc + local)},
              {"LOCAL_RANK", std::to_string(local)},
              {"WORLD_SIZE", std::to_string(job.world)},
              {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
              {"GROUP_RANK", std::to_string(options.node_rank)},
              {"MASTER_ADDR", options.master_addr},
              {"MASTER_PORT", std::to_string(port)},
              {"TORCHELASTIC_RESTART_COUNT", std::to_string(attempt)},
              {"TORCHELASTIC_MAX_RESTARTS", std::to_string(options.max_restarts)},
              {"TORCHELASTIC_RUN_ID", job.run_id}};
  if (job.set_omp) spec.env.emplace_back("OMP_NUM_THREADS", "1");
  if (options.rank0_owns_terminal && local == 0) spec.output = ProcessSpec::Output::kInherit;
  spec.error_prefix = "launch: ";
  return spec;
}

// Starts every rank once (TORCHELASTIC_RESTART_COUNT=attempt) and waits for all of them; when one
// fails, prints "launch: rank R exited with code C; <on_failure>" and stops the others. With
// `rdzv` (several nodes that restart together) a failure is told to the other nodes, and this
// node's ranks are stopped when another node's failed.
absl::StatusOr<Outcome> run_attempt(const Job& job, int port, int attempt,
                                    const std::string& on_failure, NodeRendezvous* rdzv) {
  const LaunchOptions& options = *job.options;
  const int nproc = options.nproc_per_node;
  const int node_rank = options.node_rank;
  ProcessSet ranks;  // killed and reaped however this returns
  std::vector<Relay> relays(nproc);
  for (int local = 0; local < nproc; ++local) {
    relays[local].rank = node_rank * nproc + local;
    if (absl::Status s = ranks.start(rank_spec(job, local, port, attempt)); !s.ok()) {
      // The ranks already started must not train on without their peers.
      ranks.kill_all();
      return absl::InternalError(
          absl::StrCat("launch: ", s.message(), "; the ranks already started were stopped"));
    }
  }

  Outcome outcome;
  bool stopping = false;
  std::chrono::steady_clock::time_point kill_at{};
  auto relay = [&](int i, Pipe pipe, const char* data, size_t n) { relays[i].feed(pipe, data, n); };
  while (!ranks.done()) {
    if (ranks.poll(std::chrono::milliseconds(200), relay, g_signal_pipe[0])) {
      char buf[64];
      const ssize_t n = ::read(g_signal_pipe[0], buf, sizeof(buf));
      for (ssize_t k = 0; k < n; ++k) {
        const int sig = buf[k];
        if (sig == SIGCHLD) continue;
        outcome.signalled = true;  // whatever else happens, no restart after this attempt
        if (rdzv != nullptr) rdzv->report_failure(-1, 128 + sig, true);
        // Forward the first signal; the ranks decide how to stop. A second one is escalated.
        if (!stopping) {
          std::fprintf(stderr, "launch: got signal %d, forwarding to the ranks\n", sig);
          ranks.signal_all(sig);
          stopping = true;
          if (outcome.code == 0) outcome.code = 128 + sig;
          kill_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(job.grace_ms);
        } else {
          std::fprintf(stderr, "launch: got signal %d while stopping the ranks; killing them\n",
                       sig);
          ranks.signal_all(SIGKILL);
        }
      }
    }
    for (int i : ranks.reap()) {
      const int code = ranks.exit_code(i);
      if (code != 0 && !stopping) {
        std::fprintf(stderr, "launch: rank %d exited with code %d; %s\n", relays[i].rank, code,
                     on_failure.c_str());
        outcome.code = code;
        outcome.rank = relays[i].rank;
        if (rdzv != nullptr) rdzv->report_failure(relays[i].rank, code, false);
        stopping = true;
        ranks.signal_all(SIGTERM);
        kill_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(job.grace_ms);
      }
    }
    if (rdzv != nullptr) {  // also keeps the heartbeats going while the ranks stop
      if (std::optional<std::string> why = rdzv->poll(); why.has_value() && !stopping) {
        std::fprintf(stderr, "launch: %s; stopping this node's ranks; %s\n", why->c_str(),
                     on_failure.c_str());
        outcome.stopped = true;
        stopping = true;
        ranks.signal_all(SIGTERM);
        kill_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(job.grace_ms);
      }
    }
    if (stopping && ranks.num_running() > 0 && std::chrono::steady_clock::now() >= kill_at) {
      ranks.signal_all(SIGKILL);
      kill_at = std::chrono::steady_clock::now() + std::chrono::hours(1);
    }
  }
  return outcome;
}

// What a failure in `attempt` leads to, for the line that reports it.
std::string on_failure(int attempt, int max_restarts) {
  if (attempt < max_restarts) {
    return absl::StrCat("restarting all ranks (attempt ", attempt + 2, " of ", max_restarts + 1,
                        ")");
  }
  if (max_restarts == 0) return "stopping the other ranks";
  return absl::StrCat("stopping the other ranks; no restarts left (max_restarts ", max_restarts,
                      ")");
}

// Several nodes with restarts: every attempt in lockstep through node 0's launcher
// (launcher/node_rendezvous.h). Returns as launch_local does; a signal while waiting for the other
// nodes ends it with 128 + that signal.
absl::StatusOr<int> launch_with_rendezvous(Job job) {
  const LaunchOptions& o = *job.options;
  int last_signal = 0;
  NodeRendezvousOptions r;
  r.nnodes = o.nnodes;
  r.node_rank = o.node_rank;
  r.nproc_per_node = o.nproc_per_node;
  r.max_restarts = o.max_restarts;
  r.master_addr = o.master_addr;
  r.master_port = o.master_port != 0 ? o.master_port : kDefaultMasterPort;
  r.run_id = job.run_id;
  r.rdzv_id = o.rdzv_id.empty() ? kDefaultRdzvId : o.rdzv_id;
  int refusals = 0;
  r.on_refused = [&refusals](const std::string& why) {
    if (++refusals <= kRefusalsShown) {
      std::fprintf(stderr, "launch: node 0 refused a connection from %s; the job goes on%s\n",
                   why.c_str(), refusals == kRefusalsShown ? " (further refusals not shown)" : "");
    }
  };
  r.join_timeout = std::chrono::milliseconds(static_cast<int64_t>(1000 * o.join_timeout_seconds));
  r.pending_signal = [&last_signal] {
    const int sig = pending_signal();
    if (sig != 0) last_signal = sig;
    return sig;
  };
  // A signal while waiting for the other nodes ends the launch as a signal ends an attempt.
  auto ended = [&last_signal](const absl::Status& s) -> absl::StatusOr<int> {
    if (absl::IsCancelled(s) && last_signal != 0) {
      std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
      return 128 + last_signal;
    }
    return s;
  };
  absl::StatusOr<std::unique_ptr<NodeRendezvous>> rdzv = NodeRendezvous::join(r);
  if (!rdzv.ok()) return ended(rdzv.status());
  for (;;) {
    absl::StatusOr<AttemptPlan> plan = (*rdzv)->next_attempt();
    if (!plan.ok()) return ended(plan.status());
    job.run_id = plan->run_id;  // node 0's, the same on every node
    absl::StatusOr<Outcome> outcome = run_attempt(
        job, plan->worker_port, plan->attempt,
        absl::StrCat(on_failure(plan->attempt, o.max_restarts), " on every node"), rdzv->get());
    if (!outcome.ok()) {
      (*rdzv)->report_failure(-1, 1, false);
      return outcome.status();
    }
    NodeResult result;
    result.succeeded = outcome->code == 0 && !outcome->signalled && !outcome->stopped;
    result.signalled = outcome->signalled;
    result.rank = outcome->rank;
    result.code = outcome->code;
    absl::StatusOr<Verdict> verdict = (*rdzv)->finish(result);
    if (!verdict.ok()) return ended(verdict.status());
    if (verdict->exit) return verdict->code;
  }
}

absl::Status check_options(const LaunchOptions& o) {
  return check_launch_values(launch_values(o), LaunchNames::kOptions);
}

}  // namespace

namespace {

// Numbers: "<name> must be in [lo, hi], got v<note>", the name as `names` says.
absl::Status check_launch_numbers(const LaunchValues& v, LaunchNames names) {
  const bool flags = names == LaunchNames::kFlags;
  const std::string prefix = flags ? "" : "launch: ";
  auto name = [&](const char* field, const char* flag) {
    return flags ? absl::StrCat("--", flag) : std::string(field);
  };
  auto range = [&](const std::string& n, int64_t value, int64_t lo, int64_t hi,
                   const std::string& note) {
    if (value >= lo && value <= hi) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, n, " must be in [", lo, ", ", hi, "], got ", value, note));
  };
  const std::string nnodes = name("nnodes", "nnodes"),
                    nproc = name("nproc_per_node", "nproc_per_node");
  if (absl::Status s = range(nproc, v.nproc_per_node, 1, kMaxProcsPerNode,
                             " (ranks on this node; for more ranks use more nodes)");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = range(nnodes, v.nnodes, 1, kMaxWorldSize, ""); !s.ok()) return s;
  if (absl::Status s =
          range(name("node_rank", "node_rank"), v.node_rank, 0, v.nnodes - 1,
                absl::StrCat(" (this node's index, below ", nnodes, "=", v.nnodes, ")"));
      !s.ok()) {
    return s;
  }
  const int64_t world = v.nnodes * v.nproc_per_node;  // both bounded above: no overflow
  if (world > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, nnodes, " x ", nproc, " = ", v.nnodes, " x ", v.nproc_per_node, " = ",
                     world, " ranks, more than the ", kMaxWorldSize,
                     " a job may have (the largest WORLD_SIZE the rendezvous "
                     "accepts); use fewer nodes or ranks per node"));
  }
  if (absl::Status s =
          range(name("master_port", "master_port"), v.master_port, 0, 65535, " (0 picks one)");
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          range(name("max_restarts", "max_restarts"), v.max_restarts, 0, kMaxRestarts, "");
      !s.ok()) {
    return s;
  }
  if (!(v.stop_grace_seconds >= 0 && v.stop_grace_seconds <= kMaxStopGraceSeconds)) {  // NaN too
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, name("stop_grace_seconds", "stop_grace_seconds"), " must be in [0, ",
                     kMaxStopGraceSeconds, "], got ", v.stop_grace_seconds));
  }
  if (!(v.join_timeout_seconds > 0 && v.join_timeout_seconds <= kMaxJoinTimeoutSeconds)) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, name("join_timeout_seconds", "join_timeout"), " must be in (0, ",
                     kMaxJoinTimeoutSeconds, "], got ", v.join_timeout_seconds));
  }
  return absl::OkStatus();
}

}  // namespace

LaunchValues launch_values(const LaunchOptions& o) {
  LaunchValues v;
  v.nproc_per_node = o.nproc_per_node;
  v.nnodes = o.nnodes;
  v.node_rank = o.node_rank;
  v.master_port = o.master_port;
  v.max_restarts = o.max_restarts;
  v.stop_grace_seconds = o.stop_grace_seconds;
  v.join_timeout_seconds = o.join_timeout_seconds;
  v.master_addr = o.master_addr;
  v.rdzv_id = o.rdzv_id;
  return v;
}

absl::Status check_launch_values(const LaunchValues& v, LaunchNames names) {
  if (absl::Status s = check_launch_numbers(v, names); !s.ok()) return s;
  const bool flags = names == LaunchNames::kFlags;
  const std::string prefix = flags ? "" : "launch: ";
  if (v.master_addr.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, flags ? "--" : "",
                     "master_addr is empty; give node 0's address or host name (127.0.0.1 on "
                     "one node)"));
  }
  const std::string& id = v.rdzv_id;
  const bool id_ok = id.size() <= 128 && std::all_of(id.begin(), id.end(), [](char c) {
                       return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' ||
                              c == '_' || c == '-';
                     });
  if (!id_ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, flags ? "--" : "", "rdzv_id \"", absl::CHexEscape(id.substr(0, 160)),
                     "\" must be 1 to 128 characters from [A-Za-z0-9._-] (or empty: a random id)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> launch_local(const std::vector<std::string>& argv,
                                 const LaunchOptions& options) {
  if (argv.empty() || argv[0].empty())
    return absl::InvalidArgumentError("launch: no program given");
  if (absl::Status s = check_options(options); !s.ok()) return s;
  const int nproc = options.nproc_per_node;
  const int nnodes = options.nnodes;
  const int max_restarts = options.max_restarts;
  const std::string& id = options.rdzv_id;
  const std::string program = resolve_program(argv[0]);
  std::vector<std::string> args = argv;
  args[0] = program;
  Job job;
  job.options = &options;
  job.argv = args;
  job.world = nproc * nnodes;  // check_options: at most kMaxWorldSize
  job.run_id = !id.empty() ? id
                           : absl::StrFormat("%016x", (uint64_t{std::random_device()()} << 32) ^
                                                          std::random_device()() ^
                                                          static_cast<uint64_t>(::getpid()));
  // One thread per rank is what 2-core machines can afford; torchrun does the same.
  job.set_omp =
      options.one_thread_per_rank && std::getenv("OMP_NUM_THREADS") == nullptr && nproc > 1;
  job.grace_ms = static_cast<int>(1000 * options.stop_grace_seconds);

  if (::pipe(g_signal_pipe) != 0)
    return absl::InternalError(absl::StrCat("launch: pipe: ", std::strerror(errno)));
  ::fcntl(g_signal_pipe[0], F_SETFD, FD_CLOEXEC);
  ::fcntl(g_signal_pipe[1], F_SETFD, FD_CLOEXEC);
  ::fcntl(g_signal_pipe[1], F_SETFL, O_NONBLOCK);
  // The caller's handlers come back, and the pipe is closed, however this function returns.
  struct SignalsInstalled {
    const int signals[4] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};
    struct sigaction old[4]{};
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

  if (nnodes > 1 && max_restarts > 0) return launch_with_rendezvous(job);
  int port = 0;
  for (int attempt = 0;; ++attempt) {
    // A port the launcher picks is picked afresh for every attempt: the last attempt's store may
    // still hold it.
    if (options.master_port != 0) {
      port = options.master_port;
    } else {
      port = nnodes == 1 ? fresh_port(port) : kDefaultMasterPort;
    }
    const bool last = attempt == max_restarts;
    absl::StatusOr<Outcome> outcome =
        run_attempt(job, port, attempt, on_failure(attempt, max_restarts), nullptr);
    if (!outcome.ok()) return outcome.status();
    if (outcome->code == 0 || outcome->signalled || last) return outcome->code;
    // A signal that arrived while the last rank was being reaped still cancels the restart.
    if (const int sig = pending_signal(); sig != 0) {
      std::fprintf(stderr, "launch: got signal %d; not restarting\n", sig);
      return 128 + sig;
    }
  }
}

}  // namespace dtrain::comm
