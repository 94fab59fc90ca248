// Node 0's door in the launchers' rendezvous (launcher/node_rendezvous.h): its listening socket and
// the connections that have not said their first line yet. Private to launcher/.
//
//   internal::Gate gate(*internal::listen_on(addr, port), interval, silent_limit);
//   std::vector<pollfd> fds;
//   gate.add_fds(fds);  // ... and the caller's own; ::poll(fds...)
//   for (internal::Arrival& a : gate.arrivals()) {
//     if (fits(a.lines[0])) take(std::move(a.conn));
//     else gate.refuse(std::move(a), "ERROR why");  // answered, then forgotten
//   }
//
// A connection silent for silent_limit before its first line, closed, or sending a line longer
// than kMaxLine is dropped. A refused one gets its answer and the end of node 0's stream, and is
// closed at its peer's end or after kLinger (closing with its bytes unread would reset the
// connection, and the answer could be lost); at most kMaxLingering wait at once.
#ifndef DTRAIN_LAUNCHER_INTERNAL_GATE_H_
#define DTRAIN_LAUNCHER_INTERNAL_GATE_H_

#include <poll.h>

#include <chrono>
#include <string>
#include <vector>

#include "launcher/internal/line_conn.h"

namespace dtrain::comm::internal {

inline constexpr std::chrono::seconds kLinger(2);
inline constexpr size_t kMaxLingering = 64;

// A connection that has said its first lines.
struct Arrival {
  LineConn conn;                   // closed when the peer ended its stream after these lines
  std::string from;                // the peer's host:port ("[host]:port" for IPv6)
  std::vector<std::string> lines;  // at least one
};

class Gate {
 public:
  // Takes `listen_fd` (non-blocking, as listen_on makes it).
  Gate(int listen_fd, std::chrono::milliseconds heartbeat_interval,
       std::chrono::milliseconds silent_limit);
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;
  ~Gate();

  // Appends the sockets to poll for POLLIN.
  void add_fds(std::vector<pollfd>& fds) const;
  // Never blocks: accepts what is waiting, reads the waiting connections and the refused ones, and
  // returns the connections whose first lines arrived (the caller takes or refuses each).
  std::vector<Arrival> arrivals();
  // Sends `reply`, ends this side's stream and forgets the connection.
  void refuse(Arrival a, const std::string& reply);

 private:
  struct Pending {
    LineConn conn;
    std::string from;
  };
  struct Lingering {
    LineConn conn;
    Clock::time_point until;
  };

  int listen_fd_;
  std::chrono::milliseconds interval_;
  std::chrono::milliseconds silent_limit_;
  std::vector<Pending> pending_;
  std::vector<Lingering> lingering_;
};

}  // namespace dtrain::comm::internal

#endif  // DTRAIN_LAUNCHER_INTERNAL_GATE_H_
