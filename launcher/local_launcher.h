// torchrun-style local launcher as a library: starts this node's ranks of a program with
// torchrun's environment variables, relays their output, forwards signals, stops every rank when
// one fails and, with max_restarts (torchrun's --max_restarts), starts them all again.
// //launcher:launch is its command line; examples/train uses it to launch itself.
//
//   dtrain::comm::LaunchOptions o;
//   o.nproc_per_node = 2;
//   o.rank0_owns_terminal = true;     // rank 0 may redraw a progress line in place
//   o.max_restarts = 1;               // a failed rank restarts the whole set once
//   absl::StatusOr<int> code = dtrain::comm::launch_local({"/path/to/program", "--flag"}, o);
//
// Not thread-safe: one launch per process at a time (it installs signal handlers while running and
// restores the caller's when it returns).
#ifndef DTRAIN_LAUNCHER_LOCAL_LAUNCHER_H_
#define DTRAIN_LAUNCHER_LOCAL_LAUNCHER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dtrain::comm {

// Most ranks one node may start (each costs two pipes here and a Gloo connection to every peer).
inline constexpr int kMaxProcsPerNode = 256;
// Most restarts one launch may make.
inline constexpr int kMaxRestarts = 100;
// Most ranks in a job (nnodes x nproc_per_node): the largest WORLD_SIZE the env:// rendezvous
// accepts, so a launch never hands its ranks a WORLD_SIZE (or RANK) they would refuse or that
// overflows an int.
inline constexpr int kMaxWorldSize = 1 << 30;
// Longest stop_grace_seconds.
inline constexpr double kMaxStopGraceSeconds = 3600;
// Longest join_timeout_seconds.
inline constexpr double kMaxJoinTimeoutSeconds = 86400;

// The bounded values of LaunchOptions in 64 bits (as flags parse them, before they are known to
// fit an int), and how check_launch_values names them in its messages.
struct LaunchValues {
  int64_t nproc_per_node = 0, nnodes = 0, node_rank = 0, master_port = 0, max_restarts = 0;
  double stop_grace_seconds = 0, join_timeout_seconds = 0;
  std::string master_addr, rdzv_id;
};
enum class LaunchNames {
  kOptions,  // "launch: nnodes must be in [1, 1073741824], got 0" (LaunchOptions' fields)
  kFlags,    // "--nnodes must be in [1, 1073741824], got 0" (launcher/launch_options.h's flags)
};
// The first value out of its bounds (the k* limits above), as one line naming it and its range;
// each bound checked before a product is formed. The one owner of launch's checks:
// launch_local runs it on its options, launcher/launch_options.h on the flags.
absl::Status check_launch_values(const LaunchValues& v, LaunchNames names);

struct LaunchOptions {
  int nproc_per_node = 1;  // ranks started on this node, at most kMaxProcsPerNode
  int nnodes = 1;          // nodes in the job; nnodes x nproc_per_node <= kMaxWorldSize
  int node_rank = 0;       // this node's index in [0, nnodes)
  std::string master_addr = "127.0.0.1";  // not empty
  int master_port = 0;  // in [0, 65535]; 0: a free port (one node) or 29500 (several)
  double stop_grace_seconds =
      5.0;  // after a failure or signal, before SIGKILL; [0, kMaxStopGraceSeconds]
  // Rank 0 writes straight to this process's stdout/stderr (a terminal stays a terminal); the
  // other ranks' lines are still prefixed with "[rank R] ". Default: every rank prefixed.
  bool rank0_owns_terminal = false;
  // Sets OMP_NUM_THREADS=1 for the ranks when it is unset and more than one rank shares the node
  // (torchrun does the same: N ranks x all cores oversubscribes the machine).
  bool one_thread_per_rank = true;
  // torchrun's --max_restarts, in [0, kMaxRestarts]: when a rank fails, the others are stopped and,
  // while restarts remain, every rank is started again (with a fresh MASTER_PORT when the launcher
  // picked the port itself), after one line on stderr: "launch: rank R exited with code C;
  // restarting all ranks (attempt K of N)", N being max_restarts + 1 attempts in all. Ranks read
  // which attempt they are in from TORCHELASTIC_RESTART_COUNT (0 on the first) and the limit from
  // TORCHELASTIC_MAX_RESTARTS, as under torchrun. A signal to the launcher is never followed by a
  // restart. With nnodes > 1 the nodes restart together (torchrun's c10d rendezvous plays this
  // part): node 0's launcher listens at master_addr:master_port (29500 when 0) for the others',
  // a failure on any node stops every node's ranks, node 0 decides on the restart, and each
  // attempt's MASTER_PORT (rank 0's store) is a port node 0 picks afresh and hands to every node;
  // every node must be given the same nproc_per_node, max_restarts and rdzv_id (node 0 refuses
  // a node's launcher with others, and a second launcher for a node whose launcher is alive; it
  // reports each refused connection on stderr, "launch: node 0 refused a connection from
  // HOST:PORT: <why>; the job goes on", and goes on waiting for a node that fits), and node 0's
  // run id is every node's TORCHELASTIC_RUN_ID. A node whose launcher is lost (no word for 30 s)
  // counts as failed and must join again before the next attempt; a lost node 0 ends the other
  // launches with an error. See launcher/node_rendezvous.h.
  int max_restarts = 0;
  // With nnodes > 1 and max_restarts > 0: how long node 0 waits for every node to be ready for an
  // attempt, and another node for node 0 (torchrun's join_timeout), in (0, kMaxJoinTimeoutSeconds].
  double join_timeout_seconds = 600;
  // torchrun's --rdzv_id: the job's id, handed to every rank as TORCHELASTIC_RUN_ID and the same in
  // every attempt. Empty (the default): a random id per launch (node 0's on every node with
  // nnodes > 1 and max_restarts > 0). Otherwise 1 to 128 characters from [A-Za-z0-9._-]. Give the
  // same id to launches that should count as one job (a program that records the id in its
  // checkpoints, as examples:train does, then treats them as its own). With nnodes > 1 and
  // max_restarts > 0 the nodes' launchers meet under it, or under "none" (torchrun's default)
  // when it is empty: give every node the same (or none).
  std::string rdzv_id;
};

// `o`'s bounded values, for check_launch_values (and as the flags' defaults).
LaunchValues launch_values(const LaunchOptions& o);

// Starts the ranks (argv[0] is looked up on PATH if it has no '/'; a relative path missing from
// the current directory is tried from BUILD_WORKING_DIRECTORY) and waits for all of them.
// Returns 0 when every rank of an attempt succeeded, else the first failing rank's exit code in
// the last attempt (128 + signal for a rank killed by a signal, or 128 + the signal this launcher
// received and forwarded; with nnodes > 1 and restarts, node 0's verdict: the same code on every
// node). InvalidArgument, before any rank starts, for bad options -- one line
// naming the option and its allowed range: a number outside the range given with its field above
// (nproc_per_node, nnodes, node_rank, master_port, max_restarts, stop_grace_seconds,
// join_timeout_seconds, NaN included), nnodes x nproc_per_node over kMaxWorldSize (computed in 64
// bits), an empty master_addr, an rdzv_id with other characters or over 128 long -- or an
// empty argv; Internal when pipes or fork fail (the ranks already started are killed first). With
// nnodes > 1 and restarts also the rendezvous's errors (NodeRendezvous: nodes that disagree,
// a node 0 that cannot listen, cannot be reached or is lost, a join timeout). Every rank is killed when this process dies, however it dies (PR_SET_PDEATHSIG), so no rank
// trains on without its launcher.
absl::StatusOr<int> launch_local(const std::vector<std::string>& argv,
                                 const LaunchOptions& options);

}  // namespace dtrain::comm

#endif  // DTRAIN_LAUNCHER_LOCAL_LAUNCHER_H_
