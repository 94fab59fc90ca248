// Helpers for the node rendezvous's tests (launcher/node_rendezvous.h): nodes as threads of one
// process on loopback, with short timeouts, and strangers that call on node 0's port.
#ifndef DTRAIN_LAUNCHER_NODE_RENDEZVOUS_TESTING_H_
#define DTRAIN_LAUNCHER_NODE_RENDEZVOUS_TESTING_H_

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "launcher/internal/line_conn.h"
#include "launcher/node_rendezvous.h"

namespace dtrain::comm::testing {

using namespace std::chrono_literals;  // NOLINT: the tests' durations

inline NodeRendezvousOptions options(int nnodes, int node_rank, int port, int max_restarts = 1) {
  NodeRendezvousOptions o;
  o.nnodes = nnodes;
  o.node_rank = node_rank;
  o.master_port = port;
  o.max_restarts = max_restarts;
  o.run_id = node_rank == 0 ? "job-of-node-0" : "job-of-node-" + std::to_string(node_rank);
  o.join_timeout = 10s;
  o.heartbeat_interval = 100ms;
  o.heartbeat_timeout = 1s;
  return o;
}

inline std::unique_ptr<NodeRendezvous> join(const NodeRendezvousOptions& o) {
  absl::StatusOr<std::unique_ptr<NodeRendezvous>> r = NodeRendezvous::join(o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : nullptr;
}

// Runs body(node) for every node of `nnodes` as threads, node 0 first.
inline void run_nodes(int nnodes, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int k = 0; k < nnodes; ++k) threads.emplace_back(body, k);
  for (std::thread& t : threads) t.join();
}

// Polls until a stop request arrives (or 5 s pass).
inline std::optional<std::string> wait_for_stop(NodeRendezvous& r) {
  for (auto end = std::chrono::steady_clock::now() + 5s; std::chrono::steady_clock::now() < end;) {
    if (std::optional<std::string> why = r.poll()) return why;
    std::this_thread::sleep_for(20ms);
  }
  return std::nullopt;
}

inline NodeResult succeeded() {
  NodeResult r;
  r.succeeded = true;
  return r;
}

// Connects to node 0's port as a stranger, sends `bytes` and returns all node 0 answers until it
// ends the connection (node 0 must be servicing meanwhile; a node 0 that never answers fails the
// test after 30 s instead of hanging it).
inline std::string stranger(int port, const std::string& bytes) {
  absl::StatusOr<int> fd = absl::UnavailableError("not tried");
  for (int i = 0; i < 500 && !fd.ok(); ++i) {  // node 0 may not listen yet
    fd = internal::connect_to("127.0.0.1", port);
    if (!fd.ok()) std::this_thread::sleep_for(20ms);
  }
  if (!fd.ok()) {
    ADD_FAILURE() << fd.status();
    return "";
  }
  ::fcntl(*fd, F_SETFL, 0);
  timeval tv{30, 0};
  ::setsockopt(*fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  EXPECT_EQ(::write(*fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(*fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
  ::close(*fd);
  return out;
}

}  // namespace dtrain::comm::testing

#endif  // DTRAIN_LAUNCHER_NODE_RENDEZVOUS_TESTING_H_
