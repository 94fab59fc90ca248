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
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "launcher/internal/gate.h"
#include "launcher/internal/hello.h"
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
  Leader(const NodeRendezvousOptions& o, int listen_fd)
      : o_(o),
        job_{0, o.nproc_per_node, o.nnodes, o.max_restarts, o.rdzv_id},
        gate_(listen_fd, o.heartbeat_interval, o.heartbeat_timeout) {
    nodes_.resize(o.nnodes);
  }

  absl::StatusOr<AttemptPlan> next_attempt() override {
    const int next = attempt_ + 1;
    const Clock::time_point deadline = Clock::now() + o_.join_timeout;
    for (;;) {
      if (const int sig = signalled(); sig != 0) return cancelled(sig);
      if (std::all_of(nodes_.begin() + 1, nodes_.end(),
                      [](const Node& n) { return n.conn.open() && n.ready_for >= 0; })) {
        break;
      }
      if (Clock::now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "launch: nodes ", missing(), " did not join attempt ", next, " within ",
            o_.join_timeout.count() / 1000.0, " s (node 0 listens at ", o_.master_addr, ":",
            o_.master_port, "); start their launchers with the same --master_addr, --nnodes, ",
            "--nproc_per_node, --max_restarts and --rdzv_id",
            last_refusal_.empty() ? "" : "; the last connection node 0 refused: ", last_refusal_));
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
    std::vector<pollfd> fds;
    gate_.add_fds(fds);
    for (const Node& n : nodes_) fds.push_back({n.conn.fd(), POLLIN, 0});  // -1: ignored
    ::poll(fds.data(), fds.size(), timeout_ms);
    service_nodes();  // first: a launcher that just left frees its node's place for its successor
    for (internal::Arrival& a : gate_.arrivals()) {
      const int k = hello(a);  // moves a.conn into nodes_[k], or refuses it
      for (size_t i = 1; k > 0 && i < a.lines.size(); ++i) on_line(k, a.lines[i]);
    }
  }

  void service_nodes() {
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

  // The node a connection's first line (internal/hello.h) admits it as, or -1: refused (another
  // job's launcher, a misconfigured node, a stranger, or a second launcher for a node whose
  // launcher is alive). A refusal is answered and forgotten: it is never this node's error.
  int hello(internal::Arrival& a) {
    const absl::StatusOr<int> k = internal::admit(a.lines[0], job_);
    if (!k.ok()) {
      refuse(a, "ERROR", std::string(k.status().message()));
      return -1;
    }
    Node& n = nodes_[*k];
    if (n.conn.open()) {  // alive: service_nodes() dropped it otherwise
      refuse(a, "BUSY",
             absl::StrCat("node ", *k, "'s launcher is connected and alive; another launcher for ",
                          "node ", *k, " is let in once node 0 has lost it (its connection ",
                          "closed, or no word for ", o_.heartbeat_timeout.count() / 1000.0, " s)"));
      return -1;
    }
    n.conn = std::move(a.conn);
    n.ready_for = -1;
    return *k;
  }

  void refuse(internal::Arrival& a, const std::string& kind, const std::string& why) {
    last_refusal_ = absl::StrCat(a.from, ": ", why);
    gate_.refuse(std::move(a), absl::StrCat(kind, " ", why));
    if (o_.on_refused) o_.on_refused(last_refusal_);
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
  internal::Hello job_;  // what a node's HELLO must match
  internal::Gate gate_;
  std::vector<Node> nodes_;  // [0] is this node (never connected)
  int attempt_ = -1;
  AttemptPlan plan_;
  std::optional<Failure> failure_;
  bool told_local_ = false;
  std::string last_refusal_;  // "host:port: why", for the join deadline's message
};

// Every other node: follows node 0.
class Follower : public NodeRendezvous {
 public:
  Follower(const NodeRendezvousOptions& o, LineConn conn)
      : o_(o),
        conn_(std::move(conn)),
        hello_(internal::hello_line(
            {o.node_rank, o.nproc_per_node, o.nnodes, o.max_restarts, o.rdzv_id})) {
    conn_.send(hello_);
  }

  absl::StatusOr<AttemptPlan> next_attempt() override {
    const int next = attempt_ + 1;
    ready_ = absl::StrCat("READY ", next);
    conn_.send(ready_);
    // Node 0 may wait up to its join timeout for the other nodes; then it answers.
    const Clock::time_point deadline = Clock::now() + 2 * o_.join_timeout;
    // A node that joined again after being lost starts at whatever attempt node 0 is in.
    while (!start_ || start_->attempt < next) {
      if (absl::Status s = wait_status(deadline, "its start of attempt " + std::to_string(next));
          !s.ok())
        return s;
      service(200);
    }
    attempt_ = start_->attempt;  // (the START reset the last attempt's stop and verdict)
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
    if (!conn_.open() && !busy_) {
      return absl::UnavailableError(absl::StrCat("launch: lost node 0's launcher at ", where(),
                                                 " (", lost_why_, ") while waiting for ", what));
    }
    if (const int sig = o_.pending_signal ? o_.pending_signal() : 0; sig != 0) {
      report_failure(-1, 128 + sig, true);
      return absl::CancelledError(absl::StrCat("launch: got signal ", sig, "; stopping"));
    }
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "launch: node 0's launcher at ", where(), " sent no ", what, " within ",
          2 * o_.join_timeout.count() / 1000.0, " s",
          busy_why_.empty() ? "" : "; it said: ", busy_why_,
          busy_why_.empty() ? "" : " (is another launcher running with this --node_rank?)"));
    }
    return absl::OkStatus();
  }

  void lose(const std::string& why) {
    conn_.close();
    lost_why_ = why;
    if (!stop_) stop_ = absl::StrCat("lost node 0's launcher at ", where(), ": ", why);
  }

  void service(int timeout_ms) {
    if (!conn_.open()) {
      if (busy_) rejoin(timeout_ms);
      return;
    }
    pollfd p{conn_.fd(), POLLIN, 0};
    ::poll(&p, 1, timeout_ms);
    std::vector<std::string> lines;
    const bool open = conn_.receive(lines);
    for (const std::string& line : lines) on_line(line);  // node 0's verdict comes last
    if (!open && busy_) return conn_.close();             // rejoin() tries again
    if (!open) return lose("its connection closed");
    if (conn_.silent_for() > o_.heartbeat_timeout) {
      return lose(absl::StrCat("no word for ", o_.heartbeat_timeout.count() / 1000.0, " s"));
    }
    conn_.heartbeat();
  }

  // Node 0 said BUSY: this node's place is held by a launcher it has not lost yet (this node's
  // previous launcher, whose host went away). Connects again every heartbeat interval, until the
  // join deadline, and says HELLO and READY again.
  void rejoin(int timeout_ms) {
    const Clock::time_point now = Clock::now();
    if (now < *busy_) {
      std::this_thread::sleep_for(
          std::min<Clock::duration>(*busy_ - now, std::chrono::milliseconds(timeout_ms)));
      return;
    }
    absl::StatusOr<int> fd = internal::connect_to(o_.master_addr, o_.master_port);
    if (!fd.ok()) {
      busy_ = Clock::now() + o_.heartbeat_interval;
      return;
    }
    busy_.reset();
    conn_ = LineConn(*fd, o_.heartbeat_interval);
    conn_.send(hello_);
    if (!ready_.empty()) conn_.send(ready_);
  }

  void on_line(const std::string& line) {
    const std::vector<std::string> w = absl::StrSplit(line, absl::MaxSplits(' ', 2));
    int a = 0;
    if (w[0] == "START" && w.size() == 3) {
      const std::vector<std::string> rest = absl::StrSplit(w[2], ' ');
      int port = 0;
      if (absl::SimpleAtoi(w[1], &a) && rest.size() == 2 && absl::SimpleAtoi(rest[0], &port)) {
        start_ = AttemptPlan{a, port, rest[1]};
        stop_.reset();
        told_ = false;
        verdict_.reset();
      }
      // A STOP may come in the same read as its START, before next_attempt() returns: it counts.
    } else if (w[0] == "STOP" && w.size() == 3 && absl::SimpleAtoi(w[1], &a) && start_ &&
               a == start_->attempt) {
      if (!stop_) stop_ = w[2];
    } else if (w[0] == "VERDICT" && w.size() >= 2) {
      if (w[1] == "restart") verdict_ = Verdict{false, 0};
      if (w[1] == "exit" && w.size() == 3 && absl::SimpleAtoi(w[2], &a))
        verdict_ = Verdict{true, a};
    } else if (w[0] == "ERROR" && w.size() >= 2) {
      error_ = absl::InvalidArgumentError(
          absl::StrCat("launch: node 0 refused this node: ", line.substr(6)));
    } else if (w[0] == "BUSY" && w.size() >= 2 && attempt_ < 0) {  // an answer to HELLO
      busy_why_ = line.substr(5);
      busy_ = Clock::now() + o_.heartbeat_interval;
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
  const std::string hello_;
  std::string ready_;                      // the last READY, said again after a rejoin
  std::optional<Clock::time_point> busy_;  // refused as BUSY: when to connect again
  std::string busy_why_;                   // what node 0 said then
};

}  // namespace

absl::StatusOr<std::unique_ptr<NodeRendezvous>> NodeRendezvous::join(
    const NodeRendezvousOptions& o) {
  if (!internal::valid_rdzv_id(o.rdzv_id)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "launch: rdzv_id \"", absl::CHexEscape(o.rdzv_id.substr(0, 160)), "\" must be 1 to ",
        internal::kMaxRdzvIdLength, " characters from [A-Za-z0-9._-]"));
  }
  if (o.node_rank == 0) {
    absl::StatusOr<int> fd = internal::listen_on(o.master_addr, o.master_port);
    if (!fd.ok()) return fd.status();
    return std::unique_ptr<NodeRendezvous>(new Leader(o, *fd));
  }
  const Clock::time_point deadline = Clock::now() + o.join_timeout;
  for (;;) {
    absl::StatusOr<int> fd = internal::connect_to(o.master_addr, o.master_port);
    if (fd.ok()) {
      return std::unique_ptr<NodeRendezvous>(
          new Follower(o, LineConn(*fd, o.heartbeat_interval)));  // it says HELLO
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
