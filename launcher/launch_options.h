// torchrun's flags, owned once for every program that launches ranks: //launcher:launch and
// examples:train (which launches itself). Their definitions, defaults, ranges and messages live
// here; launch_options.cc defines --nnodes, --node_rank, --master_addr, --master_port,
// --max_restarts and --rdzv_id. A program defines its own --nproc_per_node, because its default is
// the program's (1 for launch, as torchrun's; 2 for examples:train), with kNprocPerNodeHelp, and
// launch its --stop_grace_seconds and --join_timeout; to_launch_options checks them all.
//
//   ABSL_FLAG(int64_t, nproc_per_node, 1, dtrain::comm::kNprocPerNodeHelp);
//   ...
//   absl::ParseCommandLine(argc, argv);
//   dtrain::comm::LaunchFlags flags = dtrain::comm::read_launch_flags();
//   flags.nproc_per_node = absl::GetFlag(FLAGS_nproc_per_node);
//   absl::StatusOr<dtrain::comm::LaunchOptions> o = dtrain::comm::to_launch_options(flags);
//   if (!o.ok()) ...  // "--nnodes must be in [1, 1073741824], got 0": prefix the program's name
//   absl::StatusOr<int> code = dtrain::comm::launch_local(program_and_args, *o);
//
// Abseil's --help lists only the flags of the main file (<program>.cc); a program lists these
// too by accepting defines_launch_flags() in its absl::FlagsUsageConfig.
#ifndef DTRAIN_LAUNCHER_LAUNCH_OPTIONS_H_
#define DTRAIN_LAUNCHER_LAUNCH_OPTIONS_H_

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "launcher/local_launcher.h"

// 64-bit, so that a value beyond an int gets the same one-line range error as any other.
ABSL_DECLARE_FLAG(int64_t, nnodes);
ABSL_DECLARE_FLAG(int64_t, node_rank);
ABSL_DECLARE_FLAG(std::string, master_addr);
ABSL_DECLARE_FLAG(int64_t, master_port);
ABSL_DECLARE_FLAG(int64_t, max_restarts);
ABSL_DECLARE_FLAG(std::string, rdzv_id);

namespace dtrain::comm {

// The help text of every program's --nproc_per_node (define it as int64_t).
inline constexpr char kNprocPerNodeHelp[] =
    "Ranks to launch on this machine, at least 1 and at most 256 (torchrun's flag; x --nnodes at "
    "most 2^30, a job's most ranks).";

// torchrun's flags as the command line gave them, before any check: 64-bit, so that a value
// beyond an int is reported with its range instead of wrapping. The defaults are LaunchOptions'.
// The flags' values, in 64 bits (a value beyond an int is refused, not wrapped): LaunchValues,
// starting from LaunchOptions' defaults (launch_values(LaunchOptions())). nproc_per_node,
// stop_grace_seconds and join_timeout_seconds are each program's own flags (launch's
// --join_timeout; examples:train's comes from its --rendezvous_timeout_s).
using LaunchFlags = LaunchValues;

// The flags launch_options.cc defines, read after absl::ParseCommandLine; nproc_per_node,
// stop_grace_seconds and join_timeout are left at their defaults for the program to fill.
LaunchFlags read_launch_flags();

// Checks every value and returns them as LaunchOptions (the rest at its defaults), or
// InvalidArgument with one line naming the first bad flag, its range and the value, without the
// program's prefix: a number outside its range (NaN included; bounds checked before
// nnodes x nproc_per_node is formed, in 64 bits, against kMaxWorldSize), an empty master_addr, an
// rdzv_id over 128 characters or with others than [A-Za-z0-9._-]. Checked in that order.
absl::StatusOr<LaunchOptions> to_launch_options(const LaunchFlags& flags);

// Whether `file`, a flag's file as Abseil's usage config sees it (__FILE__), is the one that
// defines the flags above.
bool defines_launch_flags(absl::string_view file);

}  // namespace dtrain::comm

#endif  // DTRAIN_LAUNCHER_LAUNCH_OPTIONS_H_
