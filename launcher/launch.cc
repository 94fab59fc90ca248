// torchrun-style local launcher:
//   launch --nproc_per_node=N [--master_addr=A] [--master_port=P] [--nnodes=K --node_rank=I]
//          [--max_restarts=R [--join_timeout=S]] [--rdzv_id=ID] -- PROGRAM ARGS...
// starts N copies of PROGRAM with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR and MASTER_PORT set, prefixes every output line with "[rank R] ", forwards
// SIGINT/SIGTERM/SIGHUP to the ranks, and when a rank exits non-zero stops the others and exits
// with that rank's code (128 + signal for a rank killed by a signal), or, with --max_restarts,
// starts all ranks again up to R times (TORCHELASTIC_RESTART_COUNT tells them which attempt), on
// every node together when there are several (launcher/node_rendezvous.h).
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "launcher/local_launcher.h"

// 64-bit, so that a value beyond an int gets the same one-line range error as any other.
ABSL_FLAG(int64_t, nproc_per_node, 1, "Processes (ranks) to start on this node (1-256).");
ABSL_FLAG(int64_t, nnodes, 1,
          "Number of nodes in the job; nnodes x nproc_per_node is at most 2^30.");
ABSL_FLAG(int64_t, node_rank, 0, "This node's index in [0, nnodes).");
ABSL_FLAG(std::string, master_addr, "127.0.0.1", "Address of the node running rank 0.");
ABSL_FLAG(
    int64_t, master_port, 0,
    "Port of rank 0's rendezvous store (0-65535); 0 picks a free port (single node) or 29500.");
ABSL_FLAG(double, stop_grace_seconds, 5.0,
          "After a rank fails or a signal arrives, seconds to wait before SIGKILL (0-3600).");
ABSL_FLAG(int64_t, max_restarts, 0,
          "Times to restart all ranks after one fails (as torchrun's; 0-100); with --nnodes > 1 "
          "every node restarts together, its launcher meeting node 0's at "
          "--master_addr:--master_port. A signal to the launcher is never restarted.");
ABSL_FLAG(double, join_timeout, 600,
          "With --nnodes > 1 and --max_restarts: seconds node 0 waits for every node to be ready "
          "for an attempt, and the others for node 0 (torchrun's join_timeout; at most 86400).");
ABSL_FLAG(std::string, rdzv_id, "",
          "The job's id, given to every rank as TORCHELASTIC_RUN_ID (as torchrun's); empty: a "
          "random id per launch. With --nnodes > 1 and --max_restarts every node's launcher must "
          "be given the same (node 0 refuses others); empty means \"none\" there, as torchrun's "
          "default.");

namespace {

// "launch: --FLAG must be in [LO, HI], got V<note>" when `value` is outside, else empty.
std::string out_of_range(const char* flag, int64_t value, int64_t lo, int64_t hi,
                         const std::string& note = "") {
  if (value >= lo && value <= hi) return "";
  return absl::StrCat("launch: --", flag, " must be in [", lo, ", ", hi, "], got ", value, note);
}

// The first bad number among the flags, as one line naming the flag and its range; empty when all
// are good. Each bound is checked before a product is formed, products in 64 bits.
std::string check_numbers(int64_t nproc, int64_t nnodes, int64_t node_rank, int64_t port,
                          int64_t restarts, double grace, double join) {
  using namespace dtrain::comm;  // NOLINT: the limits
  std::string e = out_of_range("nproc_per_node", nproc, 1, kMaxProcsPerNode,
                               " (ranks on this node; for more ranks use more nodes)");
  if (e.empty()) e = out_of_range("nnodes", nnodes, 1, kMaxWorldSize);
  if (e.empty())
    e = out_of_range("node_rank", node_rank, 0, nnodes - 1,
                     absl::StrCat(" (below --nnodes=", nnodes, ")"));
  if (e.empty() && nnodes * nproc > kMaxWorldSize) {  // both bounded above: no overflow
    e = absl::StrCat("launch: --nnodes x --nproc_per_node = ", nnodes, " x ", nproc, " = ",
                     nnodes * nproc, " ranks, more than the ", kMaxWorldSize,
                     " a job may have (the largest WORLD_SIZE the "
                     "rendezvous accepts); use fewer nodes or ranks per node");
  }
  if (e.empty()) e = out_of_range("master_port", port, 0, 65535, " (0 picks one)");
  if (e.empty()) e = out_of_range("max_restarts", restarts, 0, kMaxRestarts);
  if (e.empty() && !(grace >= 0 && grace <= kMaxStopGraceSeconds)) {  // NaN too
    e = absl::StrCat("launch: --stop_grace_seconds must be in [0, ", kMaxStopGraceSeconds,
                     "], got ", grace);
  }
  if (e.empty() && !(join > 0 && join <= kMaxJoinTimeoutSeconds)) {  // NaN too
    e = absl::StrCat("launch: --join_timeout must be in (0, ", kMaxJoinTimeoutSeconds, "], got ",
                     join);
  }
  return e;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "launch --nproc_per_node=N [--master_port=P] -- PROGRAM ARGS...\n"
      "Starts N ranks of PROGRAM with torchrun's environment variables.");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  // Under `bazel run` the program starts in its runfiles; PROGRAM (bazel-bin/examples/...) and the
  // ranks' files are the user's, relative to where they typed the command, as torchrun's are.
  if (const char* cwd = std::getenv("BUILD_WORKING_DIRECTORY"); cwd != nullptr && *cwd != '\0') {
    if (::chdir(cwd) != 0) {
      std::fprintf(stderr, "launch: cannot enter BUILD_WORKING_DIRECTORY %s: %s\n", cwd,
                   std::strerror(errno));
      return 2;
    }
  }
  if (rest.size() < 2) {
    std::fprintf(stderr,
                 "launch: no program given; usage: launch --nproc_per_node=N -- PROGRAM ARGS...\n");
    return 2;
  }
  const int64_t nproc = absl::GetFlag(FLAGS_nproc_per_node), nnodes = absl::GetFlag(FLAGS_nnodes);
  const int64_t node_rank = absl::GetFlag(FLAGS_node_rank), port = absl::GetFlag(FLAGS_master_port);
  const int64_t restarts = absl::GetFlag(FLAGS_max_restarts);
  const double grace = absl::GetFlag(FLAGS_stop_grace_seconds);
  const double join = absl::GetFlag(FLAGS_join_timeout);
  if (const std::string e = check_numbers(nproc, nnodes, node_rank, port, restarts, grace, join);
      !e.empty()) {
    std::fprintf(stderr, "%s\n", e.c_str());
    return 2;
  }
  // Every number is now within an int (checked above); launch_local checks them again, and the rest.
  dtrain::comm::LaunchOptions o;
  o.nproc_per_node = static_cast<int>(nproc);
  o.nnodes = static_cast<int>(nnodes);
  o.node_rank = static_cast<int>(node_rank);
  o.master_addr = absl::GetFlag(FLAGS_master_addr);
  o.master_port = static_cast<int>(port);
  o.stop_grace_seconds = grace;
  o.max_restarts = static_cast<int>(restarts);
  o.join_timeout_seconds = join;
  o.rdzv_id = absl::GetFlag(FLAGS_rdzv_id);
  absl::StatusOr<int> code =
      dtrain::comm::launch_local(std::vector<std::string>(rest.begin() + 1, rest.end()), o);
  if (!code.ok()) {
    std::fprintf(stderr, "%s\n", std::string(code.status().message()).c_str());
    return code.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return *code;
}
