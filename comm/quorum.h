// Quorums of replica groups, as torchft's Lighthouse and Manager form them: at every outer
// synchronisation the replicas that arrive within a join timeout agree on a member list and a
// quorum id; each quorum gets a fresh Gloo process group (its store prefix is the quorum id), so a
// replica lost in an earlier quorum cannot hang this one's collectives; every member reports its
// step (the rounds it has committed), so those behind know to fetch the state from one at the
// quorum's max_step before the round is committed.
//
//   dtrain::comm::Lighthouse lighthouse;            // one per job, e.g. beside the launcher
//   dtrain::comm::QuorumOptions o;                  // in every replica group:
//   o.lighthouse_host = "10.0.0.1";
//   o.lighthouse_port = lighthouse.port();
//   o.replica_id = 2;                               // unique, kept when the replica restarts
//   o.min_replicas = 2;
//   auto client = dtrain::comm::QuorumClient::connect(o);          // StatusOr
//   absl::StatusOr<dtrain::comm::Quorum> q = (*client)->quorum(/*step=*/7, /*has_update=*/true);
//   // q->group: a Gloo group of the members; q->healing(q->rank): fetch the state from
//   // q->recover_src() first; average over q->participants().size() replicas.
//
// The protocol runs on the lighthouse's c10d TCPStore (the lighthouse is only that store: every
// decision is taken by the clients, with one compare-and-set per quorum; docs/differences.md).
// For quorum id q each replica registers (id, step, has_update, whether it is a new process);
// then any registered replica may propose the registrations it sees as the quorum, the first
// proposal winning, as soon as (a) at least min_replicas registered and (b) every member of
// quorum q - 1 registered (the fast path; at q = 1, `expected_replicas` of them) or join_timeout
// passed since it registered, and (c) q = 1 or some registered replica is not a new process (one
// holds the job's state: a lone restarted replica never starts a job of its own). A replica left
// out of quorum q (it came too late) registers at q + 1. A new process starts at the first
// undecided quorum id.
#ifndef DTRAIN_COMM_QUORUM_H_
#define DTRAIN_COMM_QUORUM_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/statusor.h"
#include "comm/process_group.h"

namespace dtrain::comm {

struct LighthouseOptions {
  // TCP port to listen on, on every interface (c10d's TCPStore server); 0: a free one (port()).
  int port = 0;
};

// The job's quorum coordinator: a c10d TCPStore server that QuorumClients meet on. Keep it on a
// host that outlives the replicas (a replica's death must not take it down).
class Lighthouse {
 public:
  // TORCH_CHECK: the port cannot be bound (say which port is in use; pick another or 0).
  explicit Lighthouse(LighthouseOptions options = {});
  int port() const;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int port_ = 0;
};

struct QuorumOptions {
  // Where the Lighthouse listens. Required: lighthouse_port.
  std::string lighthouse_host = "127.0.0.1";
  int lighthouse_port = 0;
  // This replica group's id, >= 0, unique in the job and the same when the replica restarts
  // (torchft's replica_id). Required.
  int64_t replica_id = -1;
  // No quorum with fewer members forms (torchft's min_replicas / min_replica_size). >= 1. A
  // majority of the replicas guards against two halves of a cut job going on apart.
  int min_replicas = 1;
  // The first quorum (q = 1) forms as soon as this many replicas registered; 0: only after
  // join_timeout. A dtrain addition (torchft waits join_timeout for the first quorum).
  int expected_replicas = 0;
  // How long a registered replica waits for the members of the previous quorum before proposing
  // the quorum without the missing ones: the bound within which a dead or cut-off replica is
  // dropped (torchft's join_timeout_ms, 60 s by default there).
  std::chrono::milliseconds join_timeout = std::chrono::seconds(60);
  // How long quorum() waits in all, a replica left out and registering again included, before
  // DeadlineExceeded: at least a round's duration for a replica that (re)joins a running job.
  std::chrono::milliseconds quorum_timeout = std::chrono::minutes(5);
  // Collective and rendezvous timeout of each quorum's Gloo group (torchft's Manager timeout).
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  // Address the quorum groups' Gloo binds to (InitOptions::gloo_hostname); empty: its default.
  std::string gloo_hostname;
  // The ranks of this replica group when it has more than one (a node's ranks, say, training as one
  // replica: DDP within it); unset or of size 1: a replica group of one process. Every rank of it
  // connects a QuorumClient with the same replica_id and calls quorum() at the same time with the
  // same arguments: its rank 0 alone talks to the lighthouse and hands the decision (or the error)
  // to the others over this group; then rank i of every member replica group forms the quorum's
  // `group` with the others' rank i (torchft's process group per replica rank), and the ranks
  // agree over this group that every one of them formed it (else all return Aborted). Every
  // replica group of the job must have the same size. A failure of this group (a rank of the
  // replica group lost) is Unavailable: restart the replica group (it rejoins as a new one).
  Group replica_group;
};

struct QuorumMember {
  int64_t replica_id = -1;
  int64_t step = 0;         // rounds it has committed when it registered
  bool has_update = false;  // it brings this round's update (a pseudo-gradient)
  bool fresh = false;       // a new process, never in a quorum before
};

struct Quorum {
  int64_t quorum_id = 0;
  std::vector<QuorumMember> members;  // by group rank: ascending replica_id
  int64_t max_step = 0;               // the most rounds any member has committed
  int rank = -1;                      // this replica's rank in `members` and `group`
  Group group;                        // the members' Gloo group, made for this quorum id

  // Whether member `r` is behind (its step below max_step): it must load the state of
  // recover_src() and contributes no update.
  bool healing(int r) const;
  bool any_healing() const;
  // Ranks whose updates count: has_update and step == max_step, ascending.
  std::vector<int> participants() const;
  // The rank healers fetch the state from: the lowest participant, else the lowest member at
  // max_step.
  int recover_src() const;
  std::vector<int64_t> replica_ids() const;
  // "quorum 4 (step 3): replicas 0, 2 (participants 0, 2)".
  std::string describe() const;
};

// One replica group's side of the protocol. Thread safety: none (one caller at a time).
class QuorumClient {
 public:
  // Connects to the lighthouse. Errors: InvalidArgument (an option out of range, named),
  // Unavailable / DeadlineExceeded (the lighthouse unreachable within `timeout`: say where).
  static absl::StatusOr<std::unique_ptr<QuorumClient>> connect(const QuorumOptions& options);

  // The quorum for this replica's next synchronisation (a collective among the replicas that
  // call it now). `step`: the rounds this replica has committed; `has_update`: it brings an update
  // for round `step`. Returns once this replica is a member of a decided quorum and its group is
  // made. The previous quorum's group is destroyed first. Errors: DeadlineExceeded when no quorum
  // admits this replica within quorum_timeout (the message says who registered and what was
  // missing), Unavailable when the lighthouse fails, Aborted when the quorum's group did not form
  // within `timeout` (a member died after the decision: call quorum() again; the next quorum
  // drops it after join_timeout).
  absl::StatusOr<Quorum> quorum(int64_t step, bool has_update);

  const QuorumOptions& options() const { return options_; }

 private:
  explicit QuorumClient(QuorumOptions options, c10::intrusive_ptr<c10d::Store> store);
  // The lighthouse part (a replica group's rank 0): the first decided quorum that admits `me`,
  // as its id and its members, encoded.
  absl::StatusOr<std::pair<int64_t, std::string>> decide(const QuorumMember& me);
  // Registers `me` for quorum q and waits for q's decision (its members, encoded).
  absl::StatusOr<std::string> try_quorum(int64_t q, const QuorumMember& me,
                                         std::chrono::steady_clock::time_point deadline);
  // With a replica group of several ranks: rank 0's decision (or error) on every rank.
  absl::StatusOr<std::pair<int64_t, std::string>> share_decision(
      absl::StatusOr<std::pair<int64_t, std::string>> decided);
  // After quorum q's decision (its members, encoded): this replica's place in it and its group.
  absl::StatusOr<Quorum> join_decided(int64_t q, const std::string& decision,
                                      const QuorumMember& me);
  bool grouped() const {
    return options_.replica_group.is_member() && options_.replica_group.size() > 1;
  }

  QuorumOptions options_;
  c10::intrusive_ptr<c10d::Store> store_;
  int64_t next_id_ = 0;  // 0: a new process, start at the first undecided id
  bool fresh_ = true;
  Group group_;  // the last quorum's
};

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_QUORUM_H_
