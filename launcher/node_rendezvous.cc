#include "launcher/node_rendezvous.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "launcher/internal/line_conn.h"
#include "launcher/process_set.h"

namespace dtrain::comm {
namespace {

using internal::Clock;
using internal::LineConn;

// The words of a line, and its integers from `first` on; false when one is not an integer.
bool ints(const std::vector<std::string>& w, size_t first, std::vector<int>& out) {
  out.clear();
  for (size_t i = first; i < w.size(); ++i) {
    int v = 0;
    if (!absl::SimpleAtoi(w[i], &v)) return false;
    out.push_back(v);
  }
  return true;
}

// Node 0: listens, starts attempts, decides restarts.
class Leader : public NodeRendezvous {
 public:
  Leader(const NodeRendezvousOptions& o, int listen_fd) : o_(o), listen_fd_(listen_fd) {
    nodes_.resize(o.nnodes);
  }
  ~Leader() override { ::close(listen_fd_); }

  absl::StatusOr<AttemptPlan> next_attempt() override {
    const int next = attempt_ + 1;
    const Clock::time_point deadline = Clock::now() + o_.join_timeout;
    for (;;) {
      if (!error_.ok()) return error_;
      if (const int sig = signalled(); sig != 0) return cancelled(sig);
      if (std::all_of(nodes_.begin() + 1, nodes_.end(),
                      [](const Node& n) { return n.conn.open() && n.ready_for >= 0; })) {
        break;
      }
      if (Clock::now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "launch: nodes ", missing(), " did not join attempt ", next, " within ",
            o_.join_timeout.count() / 1000.0, " s (node 0 listens at ", o_.master_addr, ":",
            o_.master_port, "); start their launchers with the same --nnodes and --master_addr"));
      }
      service(200);
    }
    attempt_ = next;
    failure_.reset();
    told_local_ = false;
    for (Node& n : nodes_) {
      n.ended = false;
      n.ready_for = -1;  // READY again before the next attempt
    }
    plan_ = AttemptPlan{attempt_, free_port(o_.master_addr), o_.run_id};
    for (Node& n : nodes_) {
      n.conn.send(absl::StrCat("START ", attempt_, " ", plan_.worker_port, " ", plan_.run_id));
    }
    return plan_;
  }

  std::optional<std::string> poll() override {
    service(0);
    if (failure_ && !told_local_ && failure_->node != 0) {
      told_local_ = true;
      return failure_->text;
    }
    return std::nullopt;
  }

  void report_failure(int rank, int code, bool signalled) override {
    fail(0, rank, code, signalled);
  }

  absl::StatusOr<Verdict> finish(const NodeResult& r) override {
    if (!r.succeeded) fail(0, r.rank, r.code, r.signalled);
    nodes_[0].ended = true;
    const Clock::time_point deadline = Clock::now() + o_.join_timeout;
    while (!std::all_of(nodes_.begin(), nodes_.end(), [](const Node& n) { return n.ended; })) {
      if (const int sig = signalled(); sig != 0) fail(0, -1, 128 + sig, true);
      if (Clock::now() >= deadline) {
        for (size_t k = 1; k < nodes_.size(); ++k) {
          if (!nodes_[k].ended) lose(k, "it did not end the attempt within the join timeout");
        }
      }
      service(200);
    }
    Verdict v;
    if (!failure_) {
      v.exit = true;
    } else if (failure_->signalled || attempt_ >= o_.max_restarts) {
      v = Verdict{true, failure_->code};
    }
    const std::string line = v.exit ? absl::StrCat("VERDICT exit ", v.code) : "VERDICT restart";
    for (Node& n : nodes_) n.conn.send(line);
    return v;
  }

 private:
  struct Node {
    LineConn conn;
    int ready_for = -1;  // the attempt it said READY for since the last START (a node that joined
                         // again counts from 0: any READY will do)
    bool ended = true;   // it ended the current attempt (or none is running)
  };
  struct Failure {
    int node = 0;
    int code = 0;
    bool signalled = false;
    std::string text;
  };

  int signalled() const { return o_.pending_signal ? o_.pending_signal() : 0; }
  static absl::Status cancelled(int sig) {
    return absl::CancelledError(absl::StrCat("launch: got signal ", sig, "; stopping"));
  }

  std::string missing() const {
    std::vector<std::string> out;
    for (size_t k = 1; k < nodes_.size(); ++k) {
      if (!nodes_[k].conn.open() || nodes_[k].ready_for < 0) out.push_back(absl::StrCat(k));
    }
    return absl::StrJoin(out, ", ");
  }

  // The first failure of an attempt stops every other node; later ones change nothing.
  void fail(int node, int rank, int code, bool signalled, const std::string& why = "") {
    if (attempt_ < 0 || failure_) return;
    std::string text =
        !why.empty() ? absl::StrCat("node ", node, "'s launcher was lost: ", why)
        : signalled  ? absl::StrCat("node ", node, "'s launcher got signal ", code - 128)
        : rank >= 0  ? absl::StrCat("rank ", rank, " (node ", node, ") exited with code ", code)
                     : absl::StrCat("node ", node, " stopped");
    failure_ = Failure{node, code, signalled, text};
    for (size_t k = 1; k < nodes_.size(); ++k) {
      if (static_cast<int>(k) != node)
        nodes_[k].conn.send(absl::StrCat("STOP ", attempt_, " ", text));
    }
  }

  void lose(size_t k, const std::string& why) {
    nodes_[k].conn.close();
    nodes_[k].ready_for = -1;
    if (!nodes_[k].ended) {
      fail(static_cast<int>(k), -1, 1, false, why);
      nodes_[k].ended = true;
    }
  }

  // Waits up to timeout_ms for messages, accepts connections, keeps heartbeats.
  void service(int timeout_ms) {
    std::vector<pollfd> fds = {{listen_fd_, POLLIN, 0}};
    for (const LineConn& c : pending_) fds.push_back({c.fd(), POLLIN, 0});
    for (const Node& n : nodes_) fds.push_back({n.conn.fd(), POLLIN, 0});  // -1: ignored
    ::poll(fds.data(), fds.size(), timeout_ms);
    if ((fds[0].revents & POLLIN) != 0) {
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd >= 0) pending_.emplace_back(fd, o_.heartbeat_interval);
    }
    for (LineConn& c : pending_) {
      std::vector<std::string> lines;
      if (!c.receive(lines) || c.silent_for() > o_.heartbeat_timeout) {
        c.close();  // gone, or silent: not a launcher
      } else if (!lines.empty()) {
        const int k = hello(c, lines[0]);  // moves c into nodes_[k]
        if (k < 0) c.close();
        for (size_t i = 1; k > 0 && i < lines.size(); ++i) on_line(k, lines[i]);
      }
    }
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [](const LineConn& c) { return !c.open(); }),
                   pending_.end());
    for (size_t k = 1; k < nodes_.size(); ++k) {
      LineConn& c = nodes_[k].conn;
      if (!c.open()) continue;
      std::vector<std::string> lines;
      const bool open = c.receive(lines);
      for (const std::string& line : lines) on_line(k, line);  // its last words count
      if (!open) {
        lose(k, "its connection closed");
      } else if (c.silent_for() > o_.heartbeat_timeout) {
        lose(k, absl::StrCat("no word for ", o_.heartbeat_timeout.count() / 1000.0, " s"));
      } else {
        c.heartbeat();
      }
    }
  }

  // A new connection's first line: "HELLO node_rank nproc_per_node nnodes max_restarts". The
  // node's index, or -1 when it is not a launcher's or does not fit this job.
  int hello(LineConn& c, const std::string& line) {
    const std::vector<std::string> w = absl::StrSplit(line, ' ');
    std::vector<int> v;
    if (w.size() != 5 || w[0] != "HELLO" || !ints(w, 1, v)) return -1;  // not a launcher
    const int k = v[0];
    if (k < 1 || k >= o_.nnodes) {  // another job's, or not a launcher: this job goes on
      c.send(absl::StrCat("ERROR node_rank ", k, " is not in [1, ", o_.nnodes - 1, "]"));
      return -1;
    }
    std::string bad;
    if (v[1] != o_.nproc_per_node || v[2] != o_.nnodes || v[3] != o_.max_restarts) {
      bad = absl::StrCat("node ", k, " has nproc_per_node ", v[1], ", nnodes ", v[2],
                         ", max_restarts ", v[3], "; node 0 has ", o_.nproc_per_node, ", ",
                         o_.nnodes, ", ", o_.max_restarts, "; give every node the same");
    }
    if (!bad.empty()) {
      c.send("ERROR " + bad);
      error_ = absl::InvalidArgumentError("launch: " + bad);
      return -1;
    }
    if (nodes_[k].conn.open()) lose(k, "it joined again");  // its old launcher is gone
    nodes_[k].conn = std::move(c);
    nodes_[k].ready_for = -1;
    return k;
  }

  void on_line(size_t k, const std::string& line) {
    const std::vector<std::string> w = absl::StrSplit(line, ' ');
    std::vector<int> v;
    if (w.empty() || w[0] == "PING" || !ints(w, 1, v)) return;
    if (w[0] == "READY" && v.size() == 1) {
      nodes_[k].ready_for = v[0];
    } else if (w[0] == "FAILED" && v.size() == 4 && v[0] == attempt_) {
      fail(static_cast<int>(k), v[1], v[2], v[3] != 0);
    } else if (w[0] == "END" && v.size() == 5 &&
               v[0] == attempt_) {  // succeeded signalled rank code
      if (v[1] == 0) fail(static_cast<int>(k), v[3], v[4], v[2] != 0);
      nodes_[k].ended = true;
    }
  }

  NodeRendezvousOptions o_;
  int listen_fd_;
  std::vector<Node> nodes_;  // [0] is this node (never connected)
  std::vector<LineConn> pending_;
  int attempt_ = -1;
  AttemptPlan plan_;
  std::optional<Failure> failure_;
  bool told_local_ = false;
  absl::Status error_;
};

// Every other node: follows node 0.
class Follower : public NodeRendezvous {
 public:
  Follower(const NodeRendezvousOptions& o, LineConn conn) : o_(o), conn_(std::move(conn)) {}

  absl::StatusOr<AttemptPlan> next_attempt() override {
    const int next = attempt_ + 1;
    conn_.send(absl::StrCat("READY ", next));
    // Node 0 may wait up to its join timeout for the other nodes; then it answers.
    const Clock::time_point deadline = Clock::now() + 2 * o_.join_timeout;
    // A node that joined again after being lost starts at whatever attempt node 0 is in.
    while (!start_ || start_->attempt < next) {
      if (absl::Status s = wait_status(deadline, "its start of attempt " + std::to_string(next));
          !s.ok())
        return s;
      service(200);
    }
    attempt_ = start_->attempt;
    stop_.reset();
    told_ = false;
    verdict_.reset();
    return *start_;
  }

  std::optional<std::string> poll() override {
    service(0);
    if (stop_ && !told_) {
      told_ = true;
      return stop_;
    }
    return std::nullopt;
  }

  void report_failure(int rank, int code, bool signalled) override {
    conn_.send(absl::StrCat("FAILED ", attempt_, " ", rank, " ", code, " ", signalled ? 1 : 0));
  }

  absl::StatusOr<Verdict> finish(const NodeResult& r) override {
    conn_.send(absl::StrCat("END ", attempt_, " ", r.succeeded ? 1 : 0, " ", r.signalled ? 1 : 0,
                            " ", r.rank, " ", r.code));
    const Clock::time_point deadline = Clock::now() + 2 * o_.join_timeout;
    while (!verdict_) {
      const absl::Status s =
          wait_status(deadline, "its verdict on attempt " + std::to_string(attempt_));
      // A signal after this node's own signal was reported changes nothing: wait for the verdict.
      if (!s.ok() && !(r.signalled && absl::IsCancelled(s))) return s;
      service(200);
    }
    return *verdict_;
  }

 private:
  std::string where() const { return absl::StrCat(o_.master_addr, ":", o_.master_port); }

  absl::Status wait_status(Clock::time_point deadline, const std::string& what) {
    if (!error_.ok()) return error_;
    if (!conn_.open()) {
      return absl::UnavailableError(absl::StrCat("launch: lost node 0's launcher at ", where(),
                                                 " (", lost_why_, ") while waiting for ", what));
    }
    if (const int sig = o_.pending_signal ? o_.pending_signal() : 0; sig != 0) {
      report_failure(-1, 128 + sig, true);
      return absl::CancelledError(absl::StrCat("launch: got signal ", sig, "; stopping"));
    }
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("launch: node 0's launcher at ", where(),
                                                      " sent no ", what, " within ",
                                                      2 * o_.join_timeout.count() / 1000.0, " s"));
    }
    return absl::OkStatus();
  }

  void lose(const std::string& why) {
    conn_.close();
    lost_why_ = why;
    if (!stop_) stop_ = absl::StrCat("lost node 0's launcher at ", where(), ": ", why);
  }

  void service(int timeout_ms) {
    if (!conn_.open()) return;
    pollfd p{conn_.fd(), POLLIN, 0};
    ::poll(&p, 1, timeout_ms);
    std::vector<std::string> lines;
    const bool open = conn_.receive(lines);
    for (const std::string& line : lines) on_line(line);  // node 0's verdict comes last
    if (!open) return lose("its connection closed");
    if (conn_.silent_for() > o_.heartbeat_timeout) {
      return lose(absl::StrCat("no word for ", o_.heartbeat_timeout.count() / 1000.0, " s"));
    }
    conn_.heartbeat();
  }

  void on_line(const std::string& line) {
    const std::vector<std::string> w = absl::StrSplit(line, absl::MaxSplits(' ', 2));
    int a = 0;
    if (w[0] == "START" && w.size() == 3) {
      const std::vector<std::string> rest = absl::StrSplit(w[2], ' ');
      int port = 0;
      if (absl::SimpleAtoi(w[1], &a) && rest.size() == 2 && absl::SimpleAtoi(rest[0], &port)) {
        start_ = AttemptPlan{a, port, rest[1]};
      }
    } else if (w[0] == "STOP" && w.size() == 3 && absl::SimpleAtoi(w[1], &a) && a == attempt_) {
      if (!stop_) stop_ = w[2];
    } else if (w[0] == "VERDICT" && w.size() >= 2) {
      if (w[1] == "restart") verdict_ = Verdict{false, 0};
      if (w[1] == "exit" && w.size() == 3 && absl::SimpleAtoi(w[2], &a))
        verdict_ = Verdict{true, a};
    } else if (w[0] == "ERROR") {
      error_ = absl::InvalidArgumentError(
          absl::StrCat("launch: node 0 refused this node: ", line.substr(6)));
    }
  }

  NodeRendezvousOptions o_;
  LineConn conn_;
  int attempt_ = -1;
  std::optional<AttemptPlan> start_;
  std::optional<std::string> stop_;
  bool told_ = false;
  std::optional<Verdict> verdict_;
  std::string lost_why_;
  absl::Status error_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<NodeRendezvous>> NodeRendezvous::join(
    const NodeRendezvousOptions& o) {
  if (o.node_rank == 0) {
    absl::StatusOr<int> fd = internal::listen_on(o.master_addr, o.master_port);
    if (!fd.ok()) return fd.status();
    return std::unique_ptr<NodeRendezvous>(new Leader(o, *fd));
  }
  const Clock::time_point deadline = Clock::now() + o.join_timeout;
  for (;;) {
    absl::StatusOr<int> fd = internal::connect_to(o.master_addr, o.master_port);
    if (fd.ok()) {
      LineConn conn(*fd, o.heartbeat_interval);
      conn.send(absl::StrCat("HELLO ", o.node_rank, " ", o.nproc_per_node, " ", o.nnodes, " ",
                             o.max_restarts));
      return std::unique_ptr<NodeRendezvous>(new Follower(o, std::move(conn)));
    }
    if (const int sig = o.pending_signal ? o.pending_signal() : 0; sig != 0) {
      return absl::CancelledError(absl::StrCat("launch: got signal ", sig, "; stopping"));
    }
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "launch: could not reach node 0's launcher at ", o.master_addr, ":", o.master_port,
          " within ", o.join_timeout.count() / 1000.0, " s (", fd.status().message(),
          "); start node 0 with the same --master_addr and --master_port"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
}

}  // namespace dtrain::comm
