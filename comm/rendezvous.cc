// The rendezvous of init_process_group and rendezvous_store: env:// / tcp:// / file:// parsing,
// the store (TCPStore or FileStore) and the arrival checks (rendezvous_checks.h), under one
// deadline. Declared in comm/internal/rendezvous.h and comm/process_group.h.
#include "comm/internal/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <utility>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "comm/exception_status.h"
#include "comm/rendezvous_checks.h"

namespace dtrain::comm {
namespace internal {

absl::StatusOr<int> parse_int(const std::string& what, const std::string& text, int lo, int hi) {
  int value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "='", text, "' is not an integer in [", lo, ", ", hi, "]"));
  }
  return value;
}

}  // namespace internal
namespace {

using internal::parse_int;
using internal::Rendezvous;

// What to check when rank 0's store accepts a connection but does not answer.
constexpr char kCheckRank0[] =
    "check that rank 0 is running and not stopped (SIGSTOP, a debugger, swapping)";

bool is_loopback(const std::string& host) {
  return absl::StartsWith(host, "127.") || host == "localhost" || host == "::1" || host == "[::1]";
}

// A socket listening on `host`'s IPv4 address only (loopback for a loopback host), for the store's
// server; -1 when the host does not resolve to a local IPv4 address (the store then listens on every
// interface, as PyTorch's does) or the bind fails, with that errno in *bind_error (EADDRINUSE: the
// port is taken).
int listen_on_host(const std::string& host, int port, int* bind_error) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(is_loopback(host) ? "127.0.0.1" : host.c_str(), nullptr, &hints, &found) != 0)
    return -1;
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(found->ai_addr);
  ::freeaddrinfo(found);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(fd, SOMAXCONN) != 0) {
    *bind_error = errno;
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whether a plain bind of `port` on every IPv4 interface (with SO_REUSEADDR, as c10d's server
// binds) fails with EADDRINUSE. Probed before the store's server tries the port itself, which on
// failure logs several lines of its own (c10d's socket.cpp) before throwing.
bool port_in_use(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool in_use =
      ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 && errno == EADDRINUSE;
  ::close(fd);
  return in_use;
}

absl::Status port_in_use_error(const std::string& master, const std::string& detail) {
  return absl::UnavailableError(absl::StrCat(
      "cannot listen on ", master,
      ": port in use (by another job, or a program that still holds it); pick "
      "another MASTER_PORT (//launcher:launch picks a free one when --master_port is left unset)",
      detail));
}

// Reads an integer environment variable; NotFound names the variable and what sets it.
absl::StatusOr<int> env_int(const char* name, int lo, int hi) {
  const char* value = std::getenv(name);
  if (value == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "env:// rendezvous: environment variable ", name,
        " expected, but not set; launch with //launcher:launch or torchrun, or export it"));
  }
  return parse_int(absl::StrCat("environment variable ", name), value, lo, hi);
}

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
      return absl::InvalidArgumentError(absl::StrCat("unknown init_method URL parameter '", p.first,
                                                     "' (expected rank, world_size)"));
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
    return absl::InvalidArgumentError(
        absl::StrCat(rank_name, "=", rank, " must be in [0, ", world_name, "=", world_size, ")"));
  }
  return absl::OkStatus();
}

absl::Status store_error(const std::exception& e, const std::string& master,
                         std::chrono::milliseconds timeout) {
  const std::string what = e.what();
  const std::string first_line = what.substr(0, what.find('\n'));
  if (absl::StrContains(what, "Address already in use")) {
    return port_in_use_error(master, absl::StrCat(" (", first_line, ")"));
  }
  // 1.13: "Socket Timeout", "timed out"; 2.x: "Timed out after N seconds waiting for clients".
  const std::string lower = absl::AsciiStrToLower(what);
  if (absl::StrContains(lower, "waiting for clients")) {
    // LibTorch 2.x: the master's store waits for every rank to connect before returning.
    return absl::DeadlineExceededError(
        absl::StrCat("rendezvous on master ", master, ": not every rank connected within ",
                     seconds_text(timeout),
                     ": check that every rank started with the same MASTER_ADDR, MASTER_PORT and "
                     "WORLD_SIZE (",
                     first_line, ")"));
  }
  if (is_timeout_message(what)) {
    // The client reached the master's port (wait_for_listener) but got no answer in time.
    return absl::DeadlineExceededError(absl::StrCat(
        "rendezvous with master ", master, " did not complete within ", seconds_text(timeout),
        ": something accepts "
        "connections there but does not answer as a c10d store; ",
        kCheckRank0,
        " and that no other program "
        "listens on MASTER_PORT (",
        first_line, ")"));
  }
  return absl::UnavailableError(
      absl::StrCat("rendezvous with master ", master, " failed: ", first_line));
}

// env://: MASTER_ADDR and MASTER_PORT, and RANK and WORLD_SIZE where `rv` does not have them yet.
absl::Status parse_env_method(Rendezvous& rv, std::string* host, int* port) {
  const char* addr = std::getenv("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0') {
    return absl::NotFoundError(
        "env:// rendezvous: environment variable MASTER_ADDR expected, but not set; set it to "
        "rank 0's address (//launcher:launch and torchrun do)");
  }
  *host = addr;
  auto p = env_int("MASTER_PORT", 1, 65535);
  if (!p.ok()) return p.status();
  *port = *p;
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
  return check_rank(rv.rank, rv.world_size, "RANK", "WORLD_SIZE");
}

// tcp://HOST:PORT?rank=&world_size=, the host without an IPv6 address's brackets.
absl::Status parse_tcp_method(const std::string& url, Rendezvous& rv, std::string* host,
                              int* port) {
  std::pair<std::string, std::string> hq = absl::StrSplit(url.substr(6), absl::MaxSplits('?', 1));
  if (absl::Status s = parse_query(hq.second, &rv.rank, &rv.world_size); !s.ok()) return s;
  const size_t colon = hq.first.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("init_method '", url, "' must be tcp://HOST:PORT"));
  }
  *host = hq.first.substr(0, colon);
  if (host->size() > 2 && host->front() == '[' && host->back() == ']')
    *host = host->substr(1, host->size() - 2);
  auto p = parse_int(absl::StrCat("port of init_method '", url, "'"), hq.first.substr(colon + 1), 1,
                     65535);
  if (!p.ok()) return p.status();
  *port = *p;
  if (absl::Status s = check_rank(rv.rank, rv.world_size, "rank", "world_size"); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        s.message(), " (tcp:// needs InitOptions rank and world_size, or ?rank=&world_size=)"));
  }
  return absl::OkStatus();
}

// file:///PATH?rank=&world_size=: the whole rendezvous, a FileStore on PATH.
absl::Status open_file_store(const std::string& url, const InitOptions& o, Rendezvous& rv) {
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
    return absl::UnavailableError(
        absl::StrCat("cannot open rendezvous file ", pq.first, ": ", e.what()));
  }
  return absl::OkStatus();
}

// Rank 0's store server listens on MASTER_ADDR's interface only (loopback stays loopback). A port in
// use is found here, by a plain bind, so that the one line it returns is all the user sees (c10d's
// server would log its failed binds first).
absl::Status listen_for_store(const std::string& host, int port, const std::string& master,
                              c10d::TCPStoreOptions& so) {
  int bind_error = 0;
  const int fd = kTcpStoreTakesListenFd ? listen_on_host(host, port, &bind_error) : -1;
  if (fd >= 0) {
    set_store_listen_fd(so, fd);
  } else if (bind_error == EADDRINUSE || port_in_use(port)) {
    return port_in_use_error(master, "");
  }
  return absl::OkStatus();
}

// The TCPStore (server on rank 0, client elsewhere), connected before `deadline`.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> connect_store(const std::string& host,
                                                              const c10d::TCPStoreOptions& so,
                                                              const std::string& master,
                                                              std::chrono::milliseconds timeout,
                                                              Deadline deadline) {
  absl::StatusOr<c10::intrusive_ptr<c10d::Store>> store =
      run_with_deadline<c10::intrusive_ptr<c10d::Store>>(
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
      return absl::DeadlineExceededError(
          absl::StrCat(store.status().message(), " (rendezvous timeout ", seconds_text(timeout),
                       "): something accepts connections on ", master,
                       " but does not answer as a c10d store; ", kCheckRank0,
                       " and that no other program listens on "
                       "MASTER_PORT"));
    }
    return store.status();
  }
  return store;
}

// Every rank announces itself on rv.store and waits for all (check_arrivals), a lost or silent
// store named as such.
absl::Status await_arrivals(const Rendezvous& rv, const std::string& master,
                            std::chrono::milliseconds timeout, Deadline deadline) {
  const int rank = rv.rank, world = rv.world_size;
  const std::string what = absl::StrCat("rendezvous on ", master);
  const std::string waiting = absl::StrCat(what, ": waiting for the c10d store");
  absl::StatusOr<bool> arrived = run_with_deadline<bool>(
      [s = rv.store, rank, world, deadline, what]() -> absl::StatusOr<bool> {
        try {
          absl::Status st = check_arrivals(*s, rank, world, deadline, what);
          if (!st.ok()) return st;
          return true;
        } catch (const std::exception& e) {
          const std::string message = e.what();
          const std::string first_line = message.substr(0, message.find('\n'));
          if (is_timeout_message(message)) {
            return absl::DeadlineExceededError(
                absl::StrCat(what, ": the c10d store that rank 0 serves stopped answering (",
                             first_line, "); ", kCheckRank0));
          }
          return absl::UnavailableError(
              absl::StrCat(what, ": lost the c10d store that rank 0 serves (", first_line,
                           "); rank 0 has exited or crashed: see its error"));
        }
      },
      deadline + std::chrono::seconds(1), waiting);
  if (!arrived.ok()) {
    if (absl::IsDeadlineExceeded(arrived.status()) &&
        absl::StartsWith(arrived.status().message(), waiting)) {
      return absl::DeadlineExceededError(
          absl::StrCat(arrived.status().message(), " (rendezvous timeout ", seconds_text(timeout),
                       " + 1 s): the c10d store that "
                       "rank 0 serves stopped answering; ",
                       kCheckRank0));
    }
    return arrived.status();
  }
  return absl::OkStatus();
}

// The tcp:// and env:// rendezvous at host:port: every step under one deadline enforced here, each
// failure with its cause (rendezvous_checks.h): reach the master, connect to its store, then every
// rank announces itself and waits for all.
absl::Status rendezvous_over_tcp(const std::string& host, int port, const InitOptions& o,
                                 Rendezvous& rv) {
  rv.master = absl::StrCat(host, ":", port);
  if (is_loopback(host)) rv.bind_host = "127.0.0.1";
  const std::chrono::milliseconds rendezvous_timeout =
      o.rendezvous_timeout.count() > 0 ? o.rendezvous_timeout : o.timeout;
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
  if (so.isServer) {
    if (absl::Status s = listen_for_store(host, port, rv.master, so); !s.ok()) return s;
  }
  const std::string master = rv.master;
  absl::StatusOr<c10::intrusive_ptr<c10d::Store>> store =
      connect_store(host, so, master, rendezvous_timeout, deadline);
  if (!store.ok()) return store.status();
  rv.store = *store;
  return await_arrivals(rv, master, rendezvous_timeout, deadline);
}

}  // namespace

namespace internal {

absl::StatusOr<Rendezvous> rendezvous(const InitOptions& o) {
  Rendezvous rv;
  rv.rank = o.rank;
  rv.world_size = o.world_size;
  if (o.store) {
    if (absl::Status s = check_rank(rv.rank, rv.world_size, "rank", "world_size"); !s.ok())
      return s;
    rv.store = o.store;
    rv.master = "in-process store";
    rv.bind_host = "127.0.0.1";
    return rv;
  }
  const std::string& url = o.init_method;
  std::string host;
  int port = 0;
  if (url == "env://" || absl::StartsWith(url, "env://")) {
    if (absl::Status s = parse_env_method(rv, &host, &port); !s.ok()) return s;
  } else if (absl::StartsWith(url, "tcp://")) {
    if (absl::Status s = parse_tcp_method(url, rv, &host, &port); !s.ok()) return s;
  } else if (absl::StartsWith(url, "file://")) {
    if (absl::Status s = open_file_store(url, o, rv); !s.ok()) return s;
    return rv;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown init_method '", url, "': use env://, tcp://HOST:PORT or file:///PATH"));
  }
  if (absl::Status s = rendezvous_over_tcp(host, port, o, rv); !s.ok()) return s;
  return rv;
}

}  // namespace internal

absl::StatusOr<RendezvousResult> rendezvous_store(const InitOptions& options) {
  if (options.timeout.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout must be positive, got ", options.timeout.count(), " ms"));
  }
  absl::StatusOr<internal::Rendezvous> rv = internal::rendezvous(options);
  if (!rv.ok()) return rv.status();
  return RendezvousResult{rv->store, rv->rank, rv->world_size};
}

}  // namespace dtrain::comm
