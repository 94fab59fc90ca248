// torchrun-style local launcher:
//   launch --nproc_per_node=N [--master_addr=A] [--master_port=P] [--nnodes=K --node_rank=I]
//          [--max_restarts=R] [--rdzv_id=ID] -- PROGRAM ARGS...
// starts N copies of PROGRAM with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR and MASTER_PORT set, prefixes every output line with "[rank R] ", forwards
// SIGINT/SIGTERM/SIGHUP to the ranks, and when a rank exits non-zero stops the others and exits
// with that rank's code (128 + signal for a rank killed by a signal), or, with --max_restarts,
// starts all ranks again up to R times (TORCHELASTIC_RESTART_COUNT tells them which attempt).
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "comm/local_launcher.h"

ABSL_FLAG(int, nproc_per_node, 1, "Processes (ranks) to start on this node.");
ABSL_FLAG(int, nnodes, 1, "Number of nodes in the job.");
ABSL_FLAG(int, node_rank, 0, "This node's index in [0, nnodes).");
ABSL_FLAG(std::string, master_addr, "127.0.0.1", "Address of the node running rank 0.");
ABSL_FLAG(int, master_port, 0,
          "Port of rank 0's rendezvous store; 0 picks a free port (single node) or 29500.");
ABSL_FLAG(double, stop_grace_seconds, 5.0,
          "After a rank fails or a signal arrives, seconds to wait before SIGKILL.");
ABSL_FLAG(int, max_restarts, 0,
          "Times to restart all ranks after one fails (as torchrun's; 0-100, single node); a signal to the "
          "launcher is never restarted.");
ABSL_FLAG(std::string, rdzv_id, "",
          "The job's id, given to every rank as TORCHELASTIC_RUN_ID (as torchrun's); empty: a random id per launch.");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "launch --nproc_per_node=N [--master_port=P] -- PROGRAM ARGS...\n"
      "Starts N ranks of PROGRAM with torchrun's environment variables.");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() < 2) {
    std::fprintf(stderr, "launch: no program given; usage: launch --nproc_per_node=N -- PROGRAM ARGS...\n");
    return 2;
  }
  dtrain::comm::LaunchOptions o;
  o.nproc_per_node = absl::GetFlag(FLAGS_nproc_per_node);
  o.nnodes = absl::GetFlag(FLAGS_nnodes);
  o.node_rank = absl::GetFlag(FLAGS_node_rank);
  o.master_addr = absl::GetFlag(FLAGS_master_addr);
  o.master_port = absl::GetFlag(FLAGS_master_port);
  o.stop_grace_seconds = absl::GetFlag(FLAGS_stop_grace_seconds);
  o.max_restarts = absl::GetFlag(FLAGS_max_restarts);
  o.rdzv_id = absl::GetFlag(FLAGS_rdzv_id);
  if (o.nproc_per_node < 1 || o.nnodes < 1 || o.node_rank < 0 || o.node_rank >= o.nnodes) {
    std::fprintf(stderr,
                 "launch: need --nproc_per_node >= 1, --nnodes >= 1 and 0 <= --node_rank < --nnodes "
                 "(got %d, %d, %d)\n", o.nproc_per_node, o.nnodes, o.node_rank);
    return 2;
  }
  if (o.max_restarts < 0 || o.max_restarts > dtrain::comm::kMaxRestarts) {
    std::fprintf(stderr, "launch: --max_restarts must be in [0, %d], got %d\n", dtrain::comm::kMaxRestarts,
                 o.max_restarts);
    return 2;
  }
  absl::StatusOr<int> code = dtrain::comm::launch_local(std::vector<std::string>(rest.begin() + 1, rest.end()), o);
  if (!code.ok()) {
    std::fprintf(stderr, "%s\n", std::string(code.status().message()).c_str());
    return code.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return *code;
}
