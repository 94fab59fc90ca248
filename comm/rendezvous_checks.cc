#include "comm/rendezvous_checks.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_join.h"

namespace dtrain::comm {
namespace {

int64_t ms_left(Deadline deadline) {
  return std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(
                                  deadline - std::chrono::steady_clock::now())
                                  .count());
}

// One non-blocking connect attempt to `ai`, waiting at most `wait_ms`. 0 on success, else errno.
int try_connect(const addrinfo* ai, int wait_ms) {
  const int fd =
      ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0) return errno;
  int err = 0;
  if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const int n = ::poll(&p, 1, wait_ms);
      if (n == 0) {
        err = ETIMEDOUT;
      } else {
        socklen_t len = sizeof(err);
        if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      }
    }
  }
  ::close(fd);
  return err;
}

std::string cause(int err) {
  switch (err) {
    case ECONNREFUSED:
      return "connection refused: nothing listens there (has rank 0 started? same MASTER_PORT?)";
    case EHOSTUNREACH:
    case ENETUNREACH:
      return "no route to the host (check MASTER_ADDR and the network)";
    case ETIMEDOUT:
      return "connection attempts time out (a firewall, or a wrong MASTER_ADDR)";
    default:
      return std::strerror(err);
  }
}

}  // namespace

absl::Status wait_for_listener(const std::string& host, int port, Deadline deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MASTER_ADDR '", host, "' does not resolve: ", ::gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owner(found, ::freeaddrinfo);
  int last = ETIMEDOUT;
  const auto start = std::chrono::steady_clock::now();
  for (int attempt = 0;; ++attempt) {
    for (const addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
      const int64_t left = ms_left(deadline);
      if (left == 0) break;
      last = try_connect(ai, static_cast<int>(std::min<int64_t>(left, 1000)));
      if (last == 0) return absl::OkStatus();
    }
    if (ms_left(deadline) == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(
        std::min<int64_t>(ms_left(deadline), 50 << std::min(attempt, 4))));
  }
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  return absl::DeadlineExceededError(absl::StrCat("cannot reach the master ", host, ":", port,
                                                  " within ", seconds_text(waited), ": ",
                                                  cause(last)));
}

absl::Status check_arrivals(c10d::Store& store, int rank, int world_size, Deadline deadline,
                            const std::string& what) {
  const std::string prefix = "dtrain/arrived/";
  const int64_t claims = store.add(absl::StrCat(prefix, rank), 1);
  if (claims > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", claims, " processes started with RANK=", rank,
                     "; give every process its own RANK in [0, WORLD_SIZE)"));
  }
  // Every rank publishes its WORLD_SIZE and compares it with every other rank's in its world, so
  // that a mismatch fails on every rank that arrived, each naming the ranks that differ (not only
  // on the rank that differs from rank 0, leaving the others to time out in Gloo).
  auto world_key = [](int r) { return absl::StrCat("dtrain/world_size/", r); };
  const std::string arrivals_key = "dtrain/arrivals", verdicts_key = "dtrain/verdicts";
  const std::string mine = std::to_string(world_size);
  store.set(world_key(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  store.add(arrivals_key, 1);
  std::vector<int> pending;  // ranks whose WORLD_SIZE this rank has not seen yet
  for (int r = 0; r < world_size; ++r) {
    if (r != rank) pending.push_back(r);
  }
  std::map<int, std::string> differing;  // rank -> its WORLD_SIZE, where it is not this rank's
  auto read_pending = [&] {
    std::erase_if(pending, [&](int r) {
      if (!store.check({world_key(r)})) return false;
      const std::vector<uint8_t> v = store.get(world_key(r));
      if (std::string theirs(v.begin(), v.end()); theirs != mine) differing[r] = theirs;
      return true;
    });
  };
  for (;;) {
    read_pending();
    if (!differing.empty() || pending.empty() || ms_left(deadline) == 0) break;
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::min<int64_t>(ms_left(deadline), 20)));
  }
  if (differing.empty() && pending.empty()) return absl::OkStatus();
  store.add(verdicts_key, 1);  // this rank is done with the store
  if (differing.empty()) {
    std::vector<int> shown(pending.begin(), pending.begin() + std::min<size_t>(pending.size(), 16));
    return absl::DeadlineExceededError(absl::StrCat(
        what, ": rank", pending.size() == 1 ? " " : "s ", absl::StrJoin(shown, ", "),
        pending.size() > 16 ? ", ..." : "", " of ", world_size,
        " never arrived (not started, crashed, or started with another MASTER_ADDR, MASTER_PORT "
        "or WORLD_SIZE)"));
  }
  if (rank == 0) {
    // Rank 0's process serves the store: it keeps it up until every rank that arrived has read its
    // own verdict (at most kLinger, and never past the deadline), so that they fail naming the
    // cause too rather than losing the store.
    constexpr auto kLinger = std::chrono::seconds(5);
    const Deadline until = std::min(deadline, std::chrono::steady_clock::now() + kLinger);
    for (;;) {
      const int64_t arrived = store.add(arrivals_key, 0);
      if (arrived >= world_size && store.add(verdicts_key, 0) >= arrived) break;
      if (ms_left(until) == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min<int64_t>(ms_left(until), 20)));
    }
    read_pending();
  }
  std::vector<std::string> theirs;
  for (const auto& [r, w] : differing) {
    if (theirs.size() == 8) {
      theirs.push_back("...");
      break;
    }
    theirs.push_back(
        absl::StrCat("rank ", r, " has WORLD_SIZE=", absl::CHexEscape(w.substr(0, 24))));
  }
  std::string absent;
  if (!pending.empty()) {
    std::vector<int> shown(pending.begin(), pending.begin() + std::min<size_t>(pending.size(), 16));
    absent = absl::StrCat("; rank", pending.size() == 1 ? " " : "s ", absl::StrJoin(shown, ", "),
                          pending.size() > 16 ? ", ..." : "",
                          pending.size() == 1 ? " has" : " have", " not arrived");
  }
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": this rank (RANK=", rank, ") has WORLD_SIZE=", world_size, " but ",
      absl::StrJoin(theirs, ", "), "; start every rank with the same WORLD_SIZE", absent));
}

}  // namespace dtrain::comm
