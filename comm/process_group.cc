#include "comm/process_group.h"
#include "comm/rendezvous_checks.h"

#include <arpa/inet.h>
#include <signal.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if DTRAIN_HAS_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace dtrain::comm {

bool nccl_available() { return DTRAIN_HAS_NCCL != 0; }

const Group::State& Group::state() const {
  TORCH_CHECK(state_ != nullptr,
              "default-constructed Group: create one with init_process_group or new_group");
  return *state_;
}
const c10::intrusive_ptr<C10dGroup>& Group::pg() const {
  TORCH_CHECK(is_member(), "this rank is not a member of the group (world ranks ",
              state_ ? absl::StrJoin(state_->global_ranks, ",") : std::string("none"),
              "): only members may use it; check is_member() first");
  return state_->pg;
}
int Group::rank() const { return pg()->getRank(); }
int Group::size() const { return pg()->getSize(); }
const std::vector<int>& Group::global_ranks() const { return state().global_ranks; }
int Group::global_rank(int group_rank) const {
  const auto& ranks = global_ranks();
  TORCH_CHECK(group_rank >= 0 && group_rank < static_cast<int>(ranks.size()), "group rank ",
              group_rank, " is out of range for a group of ", ranks.size(), " ranks");
  return ranks[group_rank];
}
int Group::world_rank() const { return state().world_rank; }
int Group::local_rank() const { return state().local_rank; }
const std::string& Group::backend() const { return state().backend; }
std::chrono::milliseconds Group::timeout() const { return state().timeout; }
const c10::intrusive_ptr<c10d::Store>& Group::store() const {
  pg();  // members only
  return state_->store;
}

const c10::intrusive_ptr<c10d::Store>& Group::root_store() const { return state().root_store; }

namespace {

bool is_loopback(const std::string& host) {
  return absl::StartsWith(host, "127.") || host == "localhost" || host == "::1" || host == "[::1]";
}

// A socket listening on `host`'s IPv4 address only (loopback for a loopback host), for the store's
// server; -1 when the host does not resolve to a local IPv4 address (the store then listens on every
// interface, as PyTorch's does).
int listen_on_host(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(is_loopback(host) ? "127.0.0.1" : host.c_str(), nullptr, &hints, &found) != 0) return -1;
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(found->ai_addr);
  ::freeaddrinfo(found);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

absl::StatusOr<int> parse_int(const std::string& what, const std::string& text, int lo, int hi) {
  int value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < lo || value > hi) {
    return absl::InvalidArgumentError(absl::StrCat(what, "='", text, "' is not an integer in [", lo,
                                                   ", ", hi, "]"));
  }
  return value;
}

// Reads an integer environment variable; NotFound names the variable and what sets it.
absl::StatusOr<int> env_int(const char* name, int lo, int hi) {
  const char* value = std::getenv(name);
  if (value == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "env:// rendezvous: environment variable ", name,
        " expected, but not set; launch with //comm:launch or torchrun, or export it"));
  }
  return parse_int(absl::StrCat("environment variable ", name), value, lo, hi);
}

struct Rendezvous {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = -1;
  int world_size = -1;
  std::string master;  // host:port or file path, for messages
  std::string bind_host;
};

// "?rank=0&world_size=2" query of a tcp:// or file:// URL.
absl::Status parse_query(const std::string& query, int* rank, int* world_size) {
  for (absl::string_view kv : absl::StrSplit(query, '&', absl::SkipEmpty())) {
    std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    if (p.first == "rank") {
      auto r = parse_int("URL rank", p.second, 0, 1 << 30);
      if (!r.ok()) return r.status();
      if (*rank < 0) *rank = *r;
    } else if (p.first == "world_size") {
      auto w = parse_int("URL world_size", p.second, 1, 1 << 30);
      if (!w.ok()) return w.status();
      if (*world_size < 0) *world_size = *w;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown init_method URL parameter '", p.first, "' (expected rank, world_size)"));
    }
  }
  return absl::OkStatus();
}

absl::Status check_rank(int rank, int world_size, const char* rank_name, const char* world_name) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(world_name, " must be at least 1, got ", world_size));
  }
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat(rank_name, "=", rank, " must be in [0, ",
                                                   world_name, "=", world_size, ")"));
  }
  return absl::OkStatus();
}

absl::Status store_error(const std::exception& e, const std::string& master,
                         std::chrono::milliseconds timeout) {
  const std::string what = e.what();
  const std::string first_line = what.substr(0, what.find('\n'));
  if (absl::StrContains(what, "Address already in use")) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", master,
                                               ": port in use; pick another MASTER_PORT (",
                                               first_line, ")"));
  }
  // 1.13: "Socket Timeout", "timed out"; 2.x: "Timed out after N seconds waiting for clients".
  const std::string lower = absl::AsciiStrToLower(what);
  if (absl::StrContains(lower, "waiting for clients")) {
    // LibTorch 2.x: the master's store waits for every rank to connect before returning.
    return absl::DeadlineExceededError(
        absl::StrCat("rendezvous on master ", master, ": not every rank connected within ", timeout.count(),
                     " ms: check that every rank started with the same MASTER_ADDR, MASTER_PORT and "
                     "WORLD_SIZE (", first_line, ")"));
  }
  if (absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout")) {
    return absl::DeadlineExceededError(
        absl::StrCat("rendezvous with master ", master, " did not complete within ",
                     timeout.count(), " ms: check that the master is reachable and every rank "
                     "started (", first_line, ")"));
  }
  return absl::UnavailableError(
      absl::StrCat("rendezvous with master ", master, " failed: ", first_line));
}

absl::StatusOr<Rendezvous> rendezvous(const InitOptions& o) {
  Rendezvous rv;
  rv.rank = o.rank;
  rv.world_size = o.world_size;
  if (o.store) {
    if (absl::Status s = check_rank(rv.rank, rv.world_size, "rank", "world_size"); !s.ok()) return s;
    rv.store = o.store;
    rv.master = "in-process store";
    rv.bind_host = "127.0.0.1";
    return rv;
  }
  const std::string& url = o.init_method;
  std::string host;
  int port = 0;
  if (url == "env://" || absl::StartsWith(url, "env://")) {
    const char* addr = std::getenv("MASTER_ADDR");
    if (addr == nullptr || *addr == '\0') {
      return absl::NotFoundError(
          "env:// rendezvous: environment variable MASTER_ADDR expected, but not set; set it to "
          "rank 0's address (//comm:launch and torchrun do)");
    }
    host = addr;
    auto p = env_int("MASTER_PORT", 1, 65535);
    if (!p.ok()) return p.status();
    port = *p;
    if (rv.rank < 0) {
      auto r = env_int("RANK", 0, 1 << 30);
      if (!r.ok()) return r.status();
      rv.rank = *r;
    }
    if (rv.world_size < 0) {
      auto w = env_int("WORLD_SIZE", 1, 1 << 30);
      if (!w.ok()) return w.status();
      rv.world_size = *w;
    }
    if (absl::Status s = check_rank(rv.rank, rv.world_size, "RANK", "WORLD_SIZE"); !s.ok()) return s;
  } else if (absl::StartsWith(url, "tcp://")) {
    std::pair<std::string, std::string> hq = absl::StrSplit(url.substr(6), absl::MaxSplits('?', 1));
    if (absl::Status s = parse_query(hq.second, &rv.rank, &rv.world_size); !s.ok()) return s;
    const size_t colon = hq.first.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("init_method '", url, "' must be tcp://HOST:PORT"));
    }
    host = hq.first.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    auto p = parse_int(absl::StrCat("port of init_method '", url, "'"), hq.first.substr(colon + 1), 1, 65535);
    if (!p.ok()) return p.status();
    port = *p;
    if (absl::Status s = check_rank(rv.rank, rv.world_size, "rank", "world_size"); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          s.message(), " (tcp:// needs InitOptions rank and world_size, or ?rank=&world_size=)"));
    }
  } else if (absl::StartsWith(url, "file://")) {
    std::pair<std::string, std::string> pq = absl::StrSplit(url.substr(7), absl::MaxSplits('?', 1));
    if (absl::Status s = parse_query(pq.second, &rv.rank, &rv.world_size); !s.ok()) return s;
    if (pq.first.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("init_method '", url, "' must be file:///PATH"));
    }
    if (absl::Status s = check_rank(rv.rank, rv.world_size, "rank", "world_size"); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          s.message(), " (file:// needs InitOptions rank and world_size, or ?rank=&world_size=)"));
    }
    rv.master = pq.first;
    try {
      rv.store = c10::make_intrusive<c10d::FileStore>(pq.first, rv.world_size);
      rv.store->setTimeout(o.timeout);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("cannot open rendezvous file ", pq.first, ": ", e.what()));
    }
    return rv;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown init_method '", url, "': use env://, tcp://HOST:PORT or file:///PATH"));
  }

  rv.master = absl::StrCat(host, ":", port);
  if (is_loopback(host)) rv.bind_host = "127.0.0.1";
  // Every step under one deadline enforced here, each failure with its cause (rendezvous_checks.h):
  // reach the master, connect to its store, then every rank announces itself and waits for all.
  const std::chrono::milliseconds rendezvous_timeout = o.rendezvous_timeout.count() > 0 ? o.rendezvous_timeout : o.timeout;
  const Deadline deadline = std::chrono::steady_clock::now() + rendezvous_timeout;
  if (rv.rank != 0) {
    if (absl::Status s = wait_for_listener(host, port, deadline); !s.ok()) return s;
  }
  c10d::TCPStoreOptions so = tcp_store_options();
  so.port = static_cast<uint16_t>(port);
  so.isServer = rv.rank == 0;
  so.numWorkers = rv.world_size;
  so.waitWorkers = false;  // check_arrivals waits, naming who is missing
  so.timeout = o.timeout;
  // The store's server listens on MASTER_ADDR's interface only (loopback stays loopback).
  if (kTcpStoreTakesListenFd && so.isServer) {
    if (const int fd = listen_on_host(host, port); fd >= 0) set_store_listen_fd(so, fd);
  }
  const std::string master = rv.master;
  const std::chrono::milliseconds timeout = rendezvous_timeout;
  absl::StatusOr<c10::intrusive_ptr<c10d::Store>> store = run_with_deadline<c10::intrusive_ptr<c10d::Store>>(
      [host, so, master, timeout]() -> absl::StatusOr<c10::intrusive_ptr<c10d::Store>> {
        try {
          return c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::TCPStore>(host, so));
        } catch (const std::exception& e) {
          return store_error(e, master, timeout);
        }
      },
      deadline, absl::StrCat("connecting to the c10d store at ", master));
  if (!store.ok()) {
    if (absl::IsDeadlineExceeded(store.status())) {
      return absl::DeadlineExceededError(absl::StrCat(store.status().message(), ": something accepts connections on ",
                                                      master, " but does not answer as a c10d store; is another "
                                                      "program using MASTER_PORT?"));
    }
    return store.status();
  }
  rv.store = *store;
  const int rank = rv.rank, world = rv.world_size;
  absl::StatusOr<bool> arrived = run_with_deadline<bool>(
      [s = rv.store, rank, world, deadline, master]() -> absl::StatusOr<bool> {
        absl::Status st = check_arrivals(*s, rank, world, deadline, absl::StrCat("rendezvous on ", master));
        if (!st.ok()) return st;
        return true;
      },
      deadline + std::chrono::seconds(1), absl::StrCat("rendezvous on ", master, " (the store stopped answering)"));
  if (!arrived.ok()) return arrived.status();
  return rv;
}

absl::StatusOr<c10::intrusive_ptr<C10dGroup>> make_pg(
    const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& bind_host, int threads) {
  if (backend == "gloo") {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    try {
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      if (!bind_host.empty()) {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind_host));
      } else if (ifname != nullptr && *ifname != '\0') {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      } else {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("cannot create a Gloo device: ", e.what()));
    }
    opts->threads = std::max(1, threads);
    try {
      return c10::intrusive_ptr<C10dGroup>(
          c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts));
    } catch (const std::exception& e) {
      const std::string what = e.what();
      return absl::DeadlineExceededError(absl::StrCat(
          "gloo rendezvous of rank ", rank, " of ", size, " failed within ", timeout.count(),
          " ms: check that every rank started and reached this call (",
          what.substr(0, what.find('\n')), ")"));
    }
  }
  if (backend == "nccl") {
#if DTRAIN_HAS_NCCL
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout;
    try {
      return c10::intrusive_ptr<C10dGroup>(
          c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts));
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("cannot create the NCCL process group: ", e.what()));
    }
#else
    return absl::UnimplementedError(
        "backend \"nccl\" requested, but this dtrain was built against a CPU-only LibTorch (no "
        "libtorch_cuda.so under LIBTORCH_HOME); use backend \"gloo\", or rebuild with "
        "LIBTORCH_HOME pointing at a CUDA LibTorch");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend \"", backend, "\": use \"gloo\" or \"nccl\""));
}

}  // namespace

absl::StatusOr<RendezvousResult> rendezvous_store(const InitOptions& options) {
  if (options.timeout.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout must be positive, got ", options.timeout.count(), " ms"));
  }
  absl::StatusOr<Rendezvous> rv = rendezvous(options);
  if (!rv.ok()) return rv.status();
  return RendezvousResult{rv->store, rv->rank, rv->world_size};
}

void ignore_sigpipe() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  struct sigaction now {};
  if (::sigaction(SIGPIPE, nullptr, &now) != 0) return;
  if ((now.sa_flags & SA_SIGINFO) == 0 && now.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

absl::StatusOr<Group> init_process_group(const InitOptions& options) {
  if (options.backend != "gloo" && options.backend != "nccl") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown backend \"", options.backend, "\": use \"gloo\" or \"nccl\""));
  }
  if (options.backend == "nccl" && !nccl_available()) {
    return make_pg("nccl", {}, 0, 1, options.timeout, "", 1).status();
  }
  if (options.timeout.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout must be positive, got ", options.timeout.count(), " ms"));
  }
  absl::StatusOr<Rendezvous> rv = rendezvous(options);
  if (!rv.ok()) return rv.status();
  ignore_sigpipe();

  auto state = std::make_shared<Group::State>();
  state->root_store = rv->store;
  state->prefix = "dtrain/world";
  state->store = c10::make_intrusive<c10d::PrefixStore>(state->prefix, rv->store);
  state->world_rank = rv->rank;
  state->global_ranks.resize(rv->world_size);
  for (int r = 0; r < rv->world_size; ++r) state->global_ranks[r] = r;
  state->backend = options.backend;
  state->timeout = options.timeout;
  state->gloo_hostname = options.gloo_hostname.empty() ? rv->bind_host : options.gloo_hostname;
  state->gloo_threads = options.gloo_threads;
  if (const char* lr = std::getenv("LOCAL_RANK"); lr != nullptr && options.store == nullptr) {
    auto local = parse_int("environment variable LOCAL_RANK", lr, 0, 1 << 20);
    if (!local.ok()) return local.status();
    state->local_rank = *local;
  }
  auto pg = make_pg(options.backend,
                    c10::make_intrusive<c10d::PrefixStore>(state->prefix + "/pg", rv->store),
                    rv->rank, rv->world_size, options.timeout, state->gloo_hostname,
                    options.gloo_threads);
  if (!pg.ok()) return pg.status();
  state->pg = *pg;
  Group g;
  g.state_ = std::move(state);
  return g;
}

absl::StatusOr<Group> new_group(const Group& parent, std::vector<int> ranks) {
  if (!parent.is_member()) {
    return absl::FailedPreconditionError(
        "new_group: this rank is not a member of the parent group; create subgroups from a group "
        "this rank belongs to (usually the world group)");
  }
  if (ranks.empty()) {
    return absl::InvalidArgumentError("new_group: the rank list is empty");
  }
  std::sort(ranks.begin(), ranks.end());
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= parent.size()) {
      return absl::InvalidArgumentError(absl::StrCat("new_group: rank ", ranks[i],
                                                     " is out of range for a parent group of ",
                                                     parent.size(), " ranks"));
    }
    if (i > 0 && ranks[i] == ranks[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("new_group: rank ", ranks[i], " is listed twice"));
    }
  }
  const Group::State& ps = *parent.state_;
  auto state = std::make_shared<Group::State>();
  // Every parent rank counts every new_group call, members or not, so names agree everywhere.
  state->prefix = absl::StrCat(ps.prefix, "/", parent.state_->children++);
  state->root_store = ps.root_store;
  state->world_rank = ps.world_rank;
  state->local_rank = ps.local_rank;
  state->backend = ps.backend;
  state->timeout = ps.timeout;
  state->gloo_hostname = ps.gloo_hostname;
  state->gloo_threads = ps.gloo_threads;
  for (int r : ranks) state->global_ranks.push_back(ps.global_ranks[r]);
  Group g;
  const int me = parent.rank();
  auto it = std::find(ranks.begin(), ranks.end(), me);
  if (it == ranks.end()) {
    g.state_ = std::move(state);  // non-member: knows the members, has no process group
    return g;
  }
  state->store = c10::make_intrusive<c10d::PrefixStore>(state->prefix, ps.root_store);
  auto pg = make_pg(ps.backend, c10::make_intrusive<c10d::PrefixStore>(state->prefix + "/pg", ps.root_store),
                    static_cast<int>(it - ranks.begin()), static_cast<int>(ranks.size()),
                    ps.timeout, ps.gloo_hostname, ps.gloo_threads);
  if (!pg.ok()) {
    return absl::Status(pg.status().code(),
                        absl::StrCat("new_group(", absl::StrJoin(ranks, ","), "): ", pg.status().message()));
  }
  state->pg = *pg;
  g.state_ = std::move(state);
  return g;
}

absl::StatusOr<Subgroups> new_subgroups(const Group& parent, int group_size) {
  if (!parent.is_member()) {
    return absl::FailedPreconditionError("new_subgroups: this rank is not a member of the parent group");
  }
  if (group_size < 1 || group_size > parent.size()) {
    return absl::InvalidArgumentError(absl::StrCat("new_subgroups: group_size ", group_size,
                                                   " must be in [1, ", parent.size(), "]"));
  }
  if (parent.size() % group_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("new_subgroups: the group size ", parent.size(),
                                                   " is not divisible by group_size ", group_size));
  }
  std::vector<std::vector<int>> lists(parent.size() / group_size);
  for (int r = 0; r < parent.size(); ++r) lists[r / group_size].push_back(r);
  return new_subgroups_by_enumeration(parent, lists);
}

absl::StatusOr<Subgroups> new_subgroups_by_enumeration(
    const Group& parent, const std::vector<std::vector<int>>& ranks_per_subgroup) {
  if (!parent.is_member()) {
    return absl::FailedPreconditionError(
        "new_subgroups_by_enumeration: this rank is not a member of the parent group");
  }
  if (ranks_per_subgroup.empty()) {
    return absl::InvalidArgumentError("new_subgroups_by_enumeration: no subgroups given");
  }
  std::map<int, size_t> seen;
  for (size_t i = 0; i < ranks_per_subgroup.size(); ++i) {
    for (int r : ranks_per_subgroup[i]) {
      auto [it, inserted] = seen.emplace(r, i);
      if (!inserted && it->second != i) {
        return absl::InvalidArgumentError(absl::StrCat("Rank ", r, " has appeared in both subgroup ",
                                                       it->second, " and ", i));
      }
    }
  }
  Subgroups out;
  for (const auto& ranks : ranks_per_subgroup) {
    absl::StatusOr<Group> g = new_group(parent, ranks);
    if (!g.ok()) return g.status();
    if (g->is_member()) out.mine = *g;
    out.all.push_back(*std::move(g));
  }
  return out;
}

}  // namespace dtrain::comm
