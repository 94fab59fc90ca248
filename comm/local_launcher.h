// torchrun-style local launcher as a library: starts this node's ranks of a program with
// torchrun's environment variables, relays their output, forwards signals and stops every rank
// when one fails. //comm:launch is its command line; examples/train uses it to launch itself.
//
//   dtrain::comm::LaunchOptions o;
//   o.nproc_per_node = 2;
//   o.rank0_owns_terminal = true;     // rank 0 may redraw a progress line in place
//   absl::StatusOr<int> code = dtrain::comm::launch_local({"/path/to/program", "--flag"}, o);
//
// Not thread-safe: one launch per process at a time (it installs signal handlers while running and
// restores the caller's when it returns).
#ifndef DTRAIN_COMM_LOCAL_LAUNCHER_H_
#define DTRAIN_COMM_LOCAL_LAUNCHER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dtrain::comm {

// Most ranks one node may start (each costs two pipes here and a Gloo connection to every peer).
inline constexpr int kMaxProcsPerNode = 256;

struct LaunchOptions {
  int nproc_per_node = 1;              // ranks started on this node, at most kMaxProcsPerNode
  int nnodes = 1;                      // nodes in the job
  int node_rank = 0;                   // this node's index in [0, nnodes)
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                 // 0: a free port (single node) or 29500
  double stop_grace_seconds = 5.0;     // after a failure or signal, before SIGKILL
  // Rank 0 writes straight to this process's stdout/stderr (a terminal stays a terminal); the
  // other ranks' lines are still prefixed with "[rank R] ". Default: every rank prefixed.
  bool rank0_owns_terminal = false;
  // Sets OMP_NUM_THREADS=1 for the ranks when it is unset and more than one rank shares the node
  // (torchrun does the same: N ranks x all cores oversubscribes the machine).
  bool one_thread_per_rank = true;
};

// Starts the ranks (argv[0] is looked up on PATH if it has no '/'; a relative path missing from
// the current directory is tried from BUILD_WORKING_DIRECTORY) and waits for all of them.
// Returns 0 when every rank succeeded, else the first failing rank's exit code (128 + signal
// for a rank killed by a signal, or 128 + the signal this launcher received and forwarded).
// InvalidArgument for bad options or an empty argv; Internal when pipes or fork fail (the ranks
// already started are killed first). Every rank is killed when this process dies, however it dies
// (PR_SET_PDEATHSIG), so no rank trains on without its launcher.
absl::StatusOr<int> launch_local(const std::vector<std::string>& argv, const LaunchOptions& options);

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_LOCAL_LAUNCHER_H_
