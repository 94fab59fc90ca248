// Lines of text over TCP for the launchers' rendezvous (launcher/node_rendezvous.h): a connection
// that never blocks, knows when its peer last spoke and sends heartbeats, and the sockets it runs
// on. Private to launcher/.
//
//   absl::StatusOr<int> fd = internal::connect_to("10.0.0.1", 29500);
//   internal::LineConn c(*fd, std::chrono::seconds(2));
//   c.send("HELLO 1 2 2 0");
//   std::vector<std::string> lines;
//   if (!c.receive(lines)) { /* closed, failed, or a line over kMaxLine */ }
#ifndef DTRAIN_LAUNCHER_INTERNAL_LINE_CONN_H_
#define DTRAIN_LAUNCHER_INTERNAL_LINE_CONN_H_

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dtrain::comm::internal {

using Clock = std::chrono::steady_clock;

// Longest line a peer may send; a longer one ends the connection (it is not a launcher).
inline constexpr size_t kMaxLine = 4096;

class LineConn {
 public:
  LineConn() = default;
  // Takes `fd` (made non-blocking); heartbeat() sends "PING" when nothing was sent for `interval`.
  LineConn(int fd, std::chrono::milliseconds interval);
  LineConn(LineConn&& other) noexcept;
  LineConn& operator=(LineConn&& other) noexcept;
  LineConn(const LineConn&) = delete;
  LineConn& operator=(const LineConn&) = delete;
  ~LineConn() { close(); }

  int fd() const { return fd_; }  // -1 when closed
  bool open() const { return fd_ >= 0; }
  void close();
  // Ends this side's stream (the peer reads what was sent, then its end); reading goes on.
  void shutdown_write();

  // Sends `line` and '\n' without blocking; closes the connection when it cannot (the peer is gone
  // or has not read for so long that the kernel's buffer is full). Nothing when closed.
  void send(const std::string& line);
  // Appends every complete line that has arrived. False (and closed) at the peer's end of stream
  // (the lines sent before it are still appended), on an error, or on a line longer than kMaxLine.
  bool receive(std::vector<std::string>& lines);
  // How long since the peer last sent anything (or since the connection was made).
  Clock::duration silent_for() const { return Clock::now() - last_heard_; }
  void heartbeat();

 private:
  int fd_ = -1;
  std::chrono::milliseconds interval_{0};
  std::string partial_;
  Clock::time_point last_heard_ = Clock::now();
  Clock::time_point last_sent_ = Clock::now();
};

// A listening socket on `addr`:`port` (that address only; SO_REUSEADDR), or Unavailable naming
// both and the reason.
absl::StatusOr<int> listen_on(const std::string& addr, int port);
// A connected socket, or Unavailable with the reason; gives up on one try after 2 s.
absl::StatusOr<int> connect_to(const std::string& addr, int port);

}  // namespace dtrain::comm::internal

#endif  // DTRAIN_LAUNCHER_INTERNAL_LINE_CONN_H_
