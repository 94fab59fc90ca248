#include "launcher/launch_options.h"

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "launcher/process_set.h"

// Defaults: LaunchOptions' (one owner); the help texts say what examples:train and launch share.
ABSL_FLAG(int64_t, nnodes, dtrain::comm::LaunchOptions().nnodes,
          "Nodes in the job (torchrun's flag), at least 1; --nnodes x --nproc_per_node ranks in "
          "all, at most 2^30.");
ABSL_FLAG(int64_t, node_rank, dtrain::comm::LaunchOptions().node_rank,
          "This node's index in [0, nnodes) (torchrun's flag).");
ABSL_FLAG(std::string, master_addr, dtrain::comm::LaunchOptions().master_addr,
          "Address of node 0, where rank 0 and its rendezvous store run (torchrun's flag); "
          "dtrain's store listens on this address only.");
static_assert(dtrain::comm::kDefaultMasterPort == 29500, "--master_port's help names the port");
ABSL_FLAG(int64_t, master_port, dtrain::comm::LaunchOptions().master_port,
          "Port of the rendezvous at --master_addr (torchrun's flag), 0-65535; 0: a free port on "
          "one node, 29500 (torchrun's) on several.");
ABSL_FLAG(int64_t, max_restarts, dtrain::comm::LaunchOptions().max_restarts,
          "Times to restart all ranks after one fails (torchrun's flag, 0-100); with --nnodes > 1 "
          "every node restarts together, its launcher meeting node 0's at "
          "--master_addr:--master_port. A signal to the launcher is never restarted.");
ABSL_FLAG(std::string, rdzv_id, dtrain::comm::LaunchOptions().rdzv_id,
          "The job's id, given to every rank as TORCHELASTIC_RUN_ID (torchrun's flag); empty: a "
          "random id per launch. With --nnodes > 1 and --max_restarts every node's launcher must "
          "be given the same (node 0 refuses others); empty means \"none\" there, as torchrun's "
          "default.");

namespace dtrain::comm {

LaunchFlags read_launch_flags() {
  LaunchFlags f = launch_values(LaunchOptions());
  f.nnodes = absl::GetFlag(FLAGS_nnodes);
  f.node_rank = absl::GetFlag(FLAGS_node_rank);
  f.master_addr = absl::GetFlag(FLAGS_master_addr);
  f.master_port = absl::GetFlag(FLAGS_master_port);
  f.max_restarts = absl::GetFlag(FLAGS_max_restarts);
  f.rdzv_id = absl::GetFlag(FLAGS_rdzv_id);
  return f;
}

absl::StatusOr<LaunchOptions> to_launch_options(const LaunchFlags& f) {
  if (absl::Status s = check_launch_values(f, LaunchNames::kFlags); !s.ok()) return s;
  // Every number is now within an int; launch_local checks them again, and the rest.
  LaunchOptions o;
  o.nproc_per_node = static_cast<int>(f.nproc_per_node);
  o.nnodes = static_cast<int>(f.nnodes);
  o.node_rank = static_cast<int>(f.node_rank);
  o.master_addr = f.master_addr;
  o.master_port = static_cast<int>(f.master_port);
  o.stop_grace_seconds = f.stop_grace_seconds;
  o.max_restarts = static_cast<int>(f.max_restarts);
  o.join_timeout_seconds = f.join_timeout_seconds;
  o.rdzv_id = f.rdzv_id;
  return o;
}

bool defines_launch_flags(absl::string_view file) {
  return absl::EndsWith(file, "launcher/launch_options.cc");
}

}  // namespace dtrain::comm
