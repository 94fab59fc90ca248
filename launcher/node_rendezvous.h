// How the launchers of a multi-node job agree on restarts (--max_restarts with --nnodes > 1): node
// 0's launcher listens at master_addr:master_port, every other node's launcher connects to it,
// and each attempt runs in lockstep on every node -- started together, stopped together when any
// rank of any node fails, restarted together while restarts remain. torchrun's c10d rendezvous
// plays this part under PyTorch. Workers do not talk to it: rank 0's store gets a fresh port per
// attempt, picked by node 0 and handed to every node (MASTER_PORT).
//
//   NodeRendezvousOptions o;  // nnodes, node_rank, master_addr, master_port, ...
//   absl::StatusOr<std::unique_ptr<NodeRendezvous>> r = NodeRendezvous::join(o);
//   for (;;) {
//     absl::StatusOr<AttemptPlan> plan = (*r)->next_attempt();   // every node is ready
//     ... start the ranks with plan->worker_port; while they run:
//     if (std::optional<std::string> why = (*r)->poll()) { ... stop this node's ranks ... }
//     ... on a rank's failure: (*r)->report_failure(rank, code, /*signalled=*/false);
//     absl::StatusOr<Verdict> v = (*r)->finish(result);   // every node has ended the attempt
//     if (v->exit) return v->code;
//   }
//
// Messages are lines of text over one TCP connection per node; both ends send a heartbeat every
// heartbeat_interval, and a peer not heard from for heartbeat_timeout is lost: a lost node counts
// as failed (it must join again before the next attempt starts, within join_timeout), a lost node
// 0 ends the other nodes' launches with an error. Not thread-safe.
//
// Who may join (node 0's port is open to anyone who can reach it; README "Security"): a node's
// first line, HELLO (internal/hello.h), must carry this job's rdzv_id, nnodes, nproc_per_node and
// max_restarts and a node_rank in [1, nnodes) whose place is free. Node 0 answers any other
// connection with one line -- "ERROR <why>" (the sender's join fails with it) or "BUSY <why>" (its
// node's launcher is connected and alive: the sender keeps trying until its join timeout, in case
// node 0 has yet to notice that its predecessor is gone) -- tells on_refused, and forgets it: a
// refusal never becomes node 0's error, and the job goes on (a misconfigured node is refused
// the same way: node 0 keeps waiting for a node that fits, and names the last refusal at its join
// deadline). The rdzv_id is a job's name, not a secret: anyone who knows it and the job's settings
// can take a node's free place before that node's launcher, or after node 0 lost it.
#ifndef DTRAIN_LAUNCHER_NODE_RENDEZVOUS_H_
#define DTRAIN_LAUNCHER_NODE_RENDEZVOUS_H_

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "launcher/process_set.h"

namespace dtrain::comm {

struct NodeRendezvousOptions {
  int nnodes = 2;                         // nodes in the job, > 1
  int node_rank = 0;                      // 0 listens, the others connect
  int nproc_per_node = 1;                 // must be the same on every node (checked at join)
  int max_restarts = 0;                   // must be the same on every node (checked at join)
  std::string master_addr = "127.0.0.1";  // node 0 listens on this address only
  int master_port = kDefaultMasterPort;   // in [1, 65535]
  std::string run_id;                     // node 0's is every node's TORCHELASTIC_RUN_ID
  // The job's id (torchrun's --rdzv_id, "none" by default as there): every node must be given the
  // same; node 0 refuses a HELLO with another. 1 to 128 characters from [A-Za-z0-9._-].
  std::string rdzv_id = "none";
  // How long node 0 waits for every node to be ready for an attempt, and another node for node 0
  // to answer (torchrun's join_timeout: 600 s).
  std::chrono::milliseconds join_timeout = std::chrono::seconds(600);
  std::chrono::milliseconds heartbeat_interval = std::chrono::seconds(2);
  std::chrono::milliseconds heartbeat_timeout = std::chrono::seconds(30);
  // Called while waiting; a nonzero signal number cancels the wait (Cancelled, naming it).
  std::function<int()> pending_signal;
  // Node 0: called with "host:port: why" for each connection it refuses (a stranger, another
  // job's launcher, a misconfigured node, a second launcher for a live node); the job goes on.
  std::function<void(const std::string&)> on_refused;
};

// One attempt, the same on every node.
struct AttemptPlan {
  int attempt = 0;      // TORCHELASTIC_RESTART_COUNT
  int worker_port = 0;  // MASTER_PORT: rank 0's store, on node 0
  std::string run_id;   // TORCHELASTIC_RUN_ID
};

// How this node's attempt ended.
struct NodeResult {
  bool succeeded = false;  // every rank of this node exited 0
  bool signalled = false;  // this launcher got a signal: no restart for anyone
  int rank = -1;           // the first failing rank of this node, -1 when none (stopped by a peer)
  int code = 0;            // its exit code, or 128 + the signal
};

// What the job does next, decided by node 0 once every node ended the attempt.
struct Verdict {
  bool exit = false;  // false: restart (call next_attempt)
  int code = 0;       // with exit: every launcher's exit code (the first failure's, or 0)
};

class NodeRendezvous {
 public:
  // Node 0: listens (Unavailable when it cannot bind master_addr:master_port). Others: connect,
  // retrying until join_timeout (DeadlineExceeded naming the address), and say HELLO.
  // InvalidArgument for an rdzv_id that is not 1 to 128 characters from [A-Za-z0-9._-].
  static absl::StatusOr<std::unique_ptr<NodeRendezvous>> join(const NodeRendezvousOptions& o);
  virtual ~NodeRendezvous() = default;

  // Waits until every node is ready for the next attempt (node 0: every node joined and ready;
  // others: node 0's start). Others: InvalidArgument when node 0 refused this node (another
  // rdzv_id, nnodes, nproc_per_node or max_restarts, or a node rank outside [1, nnodes)),
  // Unavailable when node 0 is lost. Both: DeadlineExceeded past join_timeout (node 0's names
  // the nodes missing and the last connection it refused); Cancelled on a signal.
  virtual absl::StatusOr<AttemptPlan> next_attempt() = 0;
  // Never blocks. A line naming the node and rank that failed when another node's attempt failed
  // (this node must stop its ranks), else nullopt. Also sends and checks heartbeats.
  virtual std::optional<std::string> poll() = 0;
  // Tells the other nodes now that a rank of this node failed (or a signal came).
  virtual void report_failure(int rank, int code, bool signalled) = 0;
  // Reports how this node's attempt ended and waits for every node's, then returns node 0's
  // verdict. Unavailable when node 0 is lost; Cancelled on a signal.
  virtual absl::StatusOr<Verdict> finish(const NodeResult& result) = 0;
};

}  // namespace dtrain::comm

#endif  // DTRAIN_LAUNCHER_NODE_RENDEZVOUS_H_
