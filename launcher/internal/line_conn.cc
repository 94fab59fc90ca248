#include "launcher/internal/line_conn.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dtrain::comm::internal {
namespace {

// The first address getaddrinfo gives for addr:port, or Unavailable.
absl::StatusOr<addrinfo*> resolve(const std::string& addr, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* out = nullptr;
  const int rc = ::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &out);
  if (rc != 0 || out == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", addr, ":", port, ": ", ::gai_strerror(rc)));
  }
  return out;
}

std::string where(const std::string& addr, int port) { return absl::StrCat(addr, ":", port); }

}  // namespace

LineConn::LineConn(int fd, std::chrono::milliseconds interval) : fd_(fd), interval_(interval) {
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) | O_NONBLOCK);
  ::fcntl(fd_, F_SETFD, FD_CLOEXEC);
}

LineConn::LineConn(LineConn&& other) noexcept { *this = std::move(other); }

LineConn& LineConn::operator=(LineConn&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
    interval_ = other.interval_;
    partial_ = std::move(other.partial_);
    last_heard_ = other.last_heard_;
    last_sent_ = other.last_sent_;
  }
  return *this;
}

void LineConn::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void LineConn::shutdown_write() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_WR);
}

void LineConn::send(const std::string& line) {
  if (fd_ < 0) return;
  const std::string data = line + "\n";
  const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n != static_cast<ssize_t>(data.size())) return close();  // a short write: the buffer is full
  last_sent_ = Clock::now();
}

bool LineConn::receive(std::vector<std::string>& lines) {
  if (fd_ < 0) return false;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n <= 0) {  // the end: the lines that came before it are in `lines` already
      close();
      break;
    }
    last_heard_ = Clock::now();
    partial_.append(buf, static_cast<size_t>(n));
    size_t start = 0;
    for (size_t nl; (nl = partial_.find('\n', start)) != std::string::npos; start = nl + 1) {
      lines.push_back(partial_.substr(start, nl - start));
    }
    partial_.erase(0, start);
    if (partial_.size() > kMaxLine) {
      close();
      return false;
    }
  }
  return fd_ >= 0;
}

void LineConn::heartbeat() {
  if (fd_ >= 0 && Clock::now() - last_sent_ >= interval_) send("PING");
}

absl::StatusOr<int> listen_on(const std::string& addr, int port) {
  absl::StatusOr<addrinfo*> ai = resolve(addr, port, true);
  if (!ai.ok()) return ai.status();
  const int fd = ::socket((*ai)->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  if (fd >= 0) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool ok =
      fd >= 0 && ::bind(fd, (*ai)->ai_addr, (*ai)->ai_addrlen) == 0 && ::listen(fd, 64) == 0;
  const int err = errno;
  ::freeaddrinfo(*ai);
  if (!ok) {
    if (fd >= 0) ::close(fd);
    return absl::UnavailableError(absl::StrCat("launch: node 0 cannot listen at ",
                                               where(addr, port), ": ", std::strerror(err),
                                               "; give --master_addr an address of this host and "
                                               "a free --master_port"));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  return fd;
}

absl::StatusOr<int> connect_to(const std::string& addr, int port) {
  absl::StatusOr<addrinfo*> ai = resolve(addr, port, false);
  if (!ai.ok()) return ai.status();
  const int fd = ::socket((*ai)->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int err = fd < 0 ? errno : 0;
  if (fd >= 0 && ::connect(fd, (*ai)->ai_addr, (*ai)->ai_addrlen) != 0) {
    err = errno;
    if (err == EINPROGRESS) {  // an unreachable host must not hold a try for minutes
      pollfd p{fd, POLLOUT, 0};
      socklen_t len = sizeof(err);
      err = ::poll(&p, 1, 2000) == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0
                ? err
                : ETIMEDOUT;
    }
  }
  ::freeaddrinfo(*ai);
  if (err != 0) {
    if (fd >= 0) ::close(fd);
    return absl::UnavailableError(absl::StrCat(where(addr, port), ": ", std::strerror(err)));
  }
  return fd;
}

}  // namespace dtrain::comm::internal
