#include "launcher/launch_options.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
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
namespace {

// "--FLAG must be in [LO, HI], got V<note>" when `value` is outside, else OK.
absl::Status in_range(const char* flag, int64_t value, int64_t lo, int64_t hi,
                      const std::string& note = "") {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be in [", lo, ", ", hi, "], got ", value, note));
}

// The first bad number, as one line naming the flag and its range. Each bound is checked before
// a product is formed, products in 64 bits.
absl::Status check_numbers(const LaunchFlags& f) {
  for (const absl::Status& s : {in_range("nproc_per_node", f.nproc_per_node, 1, kMaxProcsPerNode,
                                         " (ranks on this node; for more ranks use more nodes)"),
                                in_range("nnodes", f.nnodes, 1, kMaxWorldSize)}) {
    if (!s.ok()) return s;
  }
  if (absl::Status s = in_range("node_rank", f.node_rank, 0, f.nnodes - 1,
                                absl::StrCat(" (below --nnodes=", f.nnodes, ")"));
      !s.ok()) {
    return s;
  }
  if (f.nnodes * f.nproc_per_node > kMaxWorldSize) {  // both bounded above: no overflow
    return absl::InvalidArgumentError(absl::StrCat(
        "--nnodes x --nproc_per_node = ", f.nnodes, " x ", f.nproc_per_node, " = ",
        f.nnodes * f.nproc_per_node, " ranks, more than the ", kMaxWorldSize,
        " a job may have (the largest WORLD_SIZE the rendezvous accepts); use fewer nodes or "
        "ranks per node"));
  }
  for (const absl::Status& s : {in_range("master_port", f.master_port, 0, 65535, " (0 picks one)"),
                                in_range("max_restarts", f.max_restarts, 0, kMaxRestarts)}) {
    if (!s.ok()) return s;
  }
  if (!(f.stop_grace_seconds >= 0 && f.stop_grace_seconds <= kMaxStopGraceSeconds)) {  // NaN too
    return absl::InvalidArgumentError(absl::StrCat("--stop_grace_seconds must be in [0, ",
                                                   kMaxStopGraceSeconds, "], got ",
                                                   f.stop_grace_seconds));
  }
  if (!(f.join_timeout > 0 && f.join_timeout <= kMaxJoinTimeoutSeconds)) {  // NaN too
    return absl::InvalidArgumentError(absl::StrCat(
        "--join_timeout must be in (0, ", kMaxJoinTimeoutSeconds, "], got ", f.join_timeout));
  }
  return absl::OkStatus();
}

// --master_addr and --rdzv_id, as launch_local checks them.
absl::Status check_names(const LaunchFlags& f) {
  if (f.master_addr.empty()) {
    return absl::InvalidArgumentError(
        "master_addr is empty; give --master_addr node 0's address or host name (127.0.0.1 on "
        "one node)");
  }
  const std::string& id = f.rdzv_id;
  const bool id_ok = id.size() <= 128 && std::all_of(id.begin(), id.end(), [](char c) {
                       return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' ||
                              c == '_' || c == '-';
                     });
  if (!id_ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rdzv_id \"", absl::CHexEscape(id.substr(0, 160)),
                     "\" must be 1 to 128 characters from [A-Za-z0-9._-] (or empty: a random id)"));
  }
  return absl::OkStatus();
}

}  // namespace

LaunchFlags read_launch_flags() {
  LaunchFlags f;
  f.nnodes = absl::GetFlag(FLAGS_nnodes);
  f.node_rank = absl::GetFlag(FLAGS_node_rank);
  f.master_addr = absl::GetFlag(FLAGS_master_addr);
  f.master_port = absl::GetFlag(FLAGS_master_port);
  f.max_restarts = absl::GetFlag(FLAGS_max_restarts);
  f.rdzv_id = absl::GetFlag(FLAGS_rdzv_id);
  return f;
}

absl::StatusOr<LaunchOptions> to_launch_options(const LaunchFlags& f) {
  if (absl::Status s = check_numbers(f); !s.ok()) return s;
  if (absl::Status s = check_names(f); !s.ok()) return s;
  // Every number is now within an int; launch_local checks them again, and the rest.
  LaunchOptions o;
  o.nproc_per_node = static_cast<int>(f.nproc_per_node);
  o.nnodes = static_cast<int>(f.nnodes);
  o.node_rank = static_cast<int>(f.node_rank);
  o.master_addr = f.master_addr;
  o.master_port = static_cast<int>(f.master_port);
  o.stop_grace_seconds = f.stop_grace_seconds;
  o.max_restarts = static_cast<int>(f.max_restarts);
  o.join_timeout_seconds = f.join_timeout;
  o.rdzv_id = f.rdzv_id;
  return o;
}

bool defines_launch_flags(absl::string_view file) {
  return absl::EndsWith(file, "launcher/launch_options.cc");
}

}  // namespace dtrain::comm
