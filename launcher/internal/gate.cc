#include "launcher/internal/gate.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dtrain::comm::internal {
namespace {

// Most connections accepted per call to arrivals().
constexpr int kAcceptsPerCall = 16;

std::string peer_name(const sockaddr_storage& addr, socklen_t len) {
  char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
  ::getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, host, sizeof(host), serv,
                sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV);
  return addr.ss_family == AF_INET6 ? absl::StrCat("[", host, "]:", serv)
                                    : absl::StrCat(host, ":", serv);
}

}  // namespace

Gate::Gate(int listen_fd, std::chrono::milliseconds heartbeat_interval,
           std::chrono::milliseconds silent_limit)
    : listen_fd_(listen_fd), interval_(heartbeat_interval), silent_limit_(silent_limit) {}

Gate::~Gate() { ::close(listen_fd_); }

void Gate::add_fds(std::vector<pollfd>& fds) const {
  fds.push_back({listen_fd_, POLLIN, 0});
  for (const Pending& p : pending_) fds.push_back({p.conn.fd(), POLLIN, 0});
  for (const Lingering& l : lingering_) fds.push_back({l.conn.fd(), POLLIN, 0});
}

std::vector<Arrival> Gate::arrivals() {
  for (int i = 0; i < kAcceptsPerCall; ++i) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    const int fd = ::accept(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    if (fd < 0) break;
    pending_.push_back({LineConn(fd, interval_), peer_name(addr, len)});
  }
  std::vector<Arrival> out;
  for (Pending& p : pending_) {
    std::vector<std::string> lines;
    const bool open = p.conn.receive(lines);
    if (!lines.empty()) {
      out.push_back({std::move(p.conn), std::move(p.from), std::move(lines)});
    } else if (!open || p.conn.silent_for() > silent_limit_) {
      p.conn.close();  // gone, or silent: not a launcher
    }
  }
  std::erase_if(pending_, [](const Pending& p) { return !p.conn.open(); });
  for (Lingering& l : lingering_) {  // what a refused peer still sends is read and ignored
    std::vector<std::string> ignored;
    if (!l.conn.receive(ignored) || Clock::now() >= l.until) l.conn.close();
  }
  std::erase_if(lingering_, [](const Lingering& l) { return !l.conn.open(); });
  return out;
}

void Gate::refuse(Arrival a, const std::string& reply) {
  a.conn.send(reply);
  a.conn.shutdown_write();
  if (a.conn.open() && lingering_.size() < kMaxLingering) {
    lingering_.push_back({std::move(a.conn), Clock::now() + kLinger});
  }
}

}  // namespace dtrain::comm::internal
