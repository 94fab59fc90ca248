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
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "launcher/launch_options.h"
#include "launcher/local_launcher.h"

// torchrun's flags: --nnodes, --node_rank, --master_addr, --master_port, --max_restarts and
// --rdzv_id are launcher/launch_options.cc's (examples:train takes them too); these are launch's.
ABSL_FLAG(int64_t, nproc_per_node, dtrain::comm::LaunchOptions().nproc_per_node,
          dtrain::comm::kNprocPerNodeHelp);
ABSL_FLAG(double, stop_grace_seconds, dtrain::comm::LaunchOptions().stop_grace_seconds,
          "After a rank fails or a signal arrives, seconds to wait before SIGKILL (0-3600).");
ABSL_FLAG(double, join_timeout, dtrain::comm::LaunchOptions().join_timeout_seconds,
          "With --nnodes > 1 and --max_restarts: seconds node 0 waits for every node to be ready "
          "for an attempt, and the others for node 0 (torchrun's join_timeout; at most 86400).");

namespace {

// --help and --helpshort list this file's flags and launch_options.cc's (Abseil's default: only
// the flags of launch.cc).
void set_flags_usage() {
  absl::SetProgramUsageMessage(
      "launch --nproc_per_node=N [--master_port=P] -- PROGRAM ARGS...\n"
      "Starts N ranks of PROGRAM with torchrun's environment variables.");
  absl::FlagsUsageConfig config;
  auto launch_file = [](absl::string_view file) {
    return absl::EndsWith(file, "launcher/launch.cc") || dtrain::comm::defines_launch_flags(file);
  };
  config.contains_helpshort_flags = launch_file;
  config.contains_help_flags = launch_file;
  config.contains_helppackage_flags = launch_file;
  absl::SetFlagsUsageConfig(config);
}

}  // namespace

int main(int argc, char** argv) {
  set_flags_usage();
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
  dtrain::comm::LaunchFlags flags = dtrain::comm::read_launch_flags();
  flags.nproc_per_node = absl::GetFlag(FLAGS_nproc_per_node);
  flags.stop_grace_seconds = absl::GetFlag(FLAGS_stop_grace_seconds);
  flags.join_timeout_seconds = absl::GetFlag(FLAGS_join_timeout);
  const absl::StatusOr<dtrain::comm::LaunchOptions> o = dtrain::comm::to_launch_options(flags);
  if (!o.ok()) {
    std::fprintf(stderr, "launch: %s\n", std::string(o.status().message()).c_str());
    return 2;
  }
  absl::StatusOr<int> code =
      dtrain::comm::launch_local(std::vector<std::string>(rest.begin() + 1, rest.end()), *o);
  if (!code.ok()) {
    std::fprintf(stderr, "%s\n", std::string(code.status().message()).c_str());
    return code.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return *code;
}
