#include "comm/rendezvous_checks.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_join.h"

namespace dtrain::comm {
namespace {

int64_t ms_left(Deadline deadline) {
  return std::max<int64_t>(
      0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
}

// One non-blocking connect attempt to `ai`, waiting at most `wait_ms`. 0 on success, else errno.
int try_connect(const addrinfo* ai, int wait_ms) {
  const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
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
    case ECONNREFUSED: return "connection refused: nothing listens there (has rank 0 started? same MASTER_PORT?)";
    case EHOSTUNREACH: case ENETUNREACH: return "no route to the host (check MASTER_ADDR and the network)";
    case ETIMEDOUT: return "connection attempts time out (a firewall, or a wrong MASTER_ADDR)";
    default: return std::strerror(err);
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
    return absl::InvalidArgumentError(absl::StrCat("MASTER_ADDR '", host, "' does not resolve: ", ::gai_strerror(rc)));
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
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min<int64_t>(ms_left(deadline), 50 << std::min(attempt, 4))));
  }
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  return absl::DeadlineExceededError(absl::StrCat("cannot reach the master ", host, ":", port, " within ",
                                                  waited.count(), " ms: ", cause(last)));
}

absl::Status check_arrivals(c10d::Store& store, int rank, int world_size, Deadline deadline, const std::string& what) {
  const std::string prefix = "dtrain/arrived/";
  const int64_t claims = store.add(absl::StrCat(prefix, rank), 1);
  if (claims > 1) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", claims, " processes started with RANK=", rank,
                                                   "; give every process its own RANK in [0, WORLD_SIZE)"));
  }
  const std::string world_key = absl::StrCat(prefix, "world_size");
  const std::string mine = std::to_string(world_size);
  if (rank == 0) store.set(world_key, std::vector<uint8_t>(mine.begin(), mine.end()));
  bool world_checked = false;
  std::vector<int> missing;
  for (;;) {
    if (!world_checked && store.check({world_key})) {
      const std::vector<uint8_t> v = store.get(world_key);
      const std::string theirs(v.begin(), v.end());
      if (theirs != mine) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": this rank (RANK=", rank, ") has WORLD_SIZE=", world_size,
                                                       " but rank 0 has WORLD_SIZE=", theirs,
                                                       "; start every rank with the same WORLD_SIZE"));
      }
      world_checked = true;
    }
    missing.clear();
    for (int r = 0; r < world_size; ++r) {
      if (!store.check({absl::StrCat(prefix, r)})) missing.push_back(r);
    }
    if (missing.empty() && world_checked) return absl::OkStatus();
    if (ms_left(deadline) == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min<int64_t>(ms_left(deadline), 20)));
  }
  std::vector<int> shown(missing.begin(), missing.begin() + std::min<size_t>(missing.size(), 16));
  return absl::DeadlineExceededError(absl::StrCat(
      what, ": rank", missing.size() == 1 ? " " : "s ", absl::StrJoin(shown, ", "), missing.size() > 16 ? ", ..." : "",
      " of ", world_size, " never arrived (not started, crashed, or started with another MASTER_ADDR, MASTER_PORT "
      "or WORLD_SIZE)"));
}

}  // namespace dtrain::comm
