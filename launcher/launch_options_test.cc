#include "launcher/launch_options.h"

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "launcher/local_launcher.h"

namespace dtrain::comm {
namespace {

using ::testing::HasSubstr;

// The flags' defaults are LaunchOptions': read unparsed and converted, they give LaunchOptions{}.
TEST(LaunchOptionsTest, DefaultsAreLaunchOptionsDefaults) {
  absl::FlagSaver restore;
  absl::StatusOr<LaunchOptions> o = to_launch_options(read_launch_flags());
  ASSERT_TRUE(o.ok()) << o.status();
  const LaunchOptions d;
  EXPECT_EQ(o->nproc_per_node, d.nproc_per_node);
  EXPECT_EQ(o->nnodes, d.nnodes);
  EXPECT_EQ(o->node_rank, d.node_rank);
  EXPECT_EQ(o->master_addr, d.master_addr);
  EXPECT_EQ(o->master_port, d.master_port);
  EXPECT_EQ(o->stop_grace_seconds, d.stop_grace_seconds);
  EXPECT_EQ(o->max_restarts, d.max_restarts);
  EXPECT_EQ(o->join_timeout_seconds, d.join_timeout_seconds);
  EXPECT_EQ(o->rdzv_id, d.rdzv_id);
}

TEST(LaunchOptionsTest, ReadsTheFlagsAndConvertsEveryValue) {
  absl::FlagSaver restore;
  absl::SetFlag(&FLAGS_nnodes, 3);
  absl::SetFlag(&FLAGS_node_rank, 2);
  absl::SetFlag(&FLAGS_master_addr, "node0.example");
  absl::SetFlag(&FLAGS_master_port, 29999);
  absl::SetFlag(&FLAGS_max_restarts, 4);
  absl::SetFlag(&FLAGS_rdzv_id, "job-7.a_b");
  LaunchFlags f = read_launch_flags();
  f.nproc_per_node = 8;
  f.stop_grace_seconds = 1.5;
  f.join_timeout_seconds = 30;
  absl::StatusOr<LaunchOptions> o = to_launch_options(f);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->nproc_per_node, 8);
  EXPECT_EQ(o->nnodes, 3);
  EXPECT_EQ(o->node_rank, 2);
  EXPECT_EQ(o->master_addr, "node0.example");
  EXPECT_EQ(o->master_port, 29999);
  EXPECT_EQ(o->max_restarts, 4);
  EXPECT_EQ(o->rdzv_id, "job-7.a_b");
  EXPECT_EQ(o->stop_grace_seconds, 1.5);
  EXPECT_EQ(o->join_timeout_seconds, 30);
}

// Each bad value: InvalidArgument, one line naming the flag, its range and the value (64-bit: a
// value beyond an int is not wrapped), without a program's prefix.
TEST(LaunchOptionsTest, EveryBadValueIsOneLineNamingTheFlag) {
  const std::vector<std::pair<std::function<void(LaunchFlags&)>, std::string>> cases = {
      {[](LaunchFlags& f) { f.nproc_per_node = 0; },
       "--nproc_per_node must be in [1, 256], got 0 (ranks on this node; for more ranks use more "
       "nodes)"},
      {[](LaunchFlags& f) { f.nproc_per_node = 4294967297; },
       "--nproc_per_node must be in [1, 256], got 4294967297"},
      {[](LaunchFlags& f) { f.nnodes = 0; }, "--nnodes must be in [1, 1073741824], got 0"},
      {[](LaunchFlags& f) { f.nnodes = 4294967298, f.node_rank = 1; },
       "--nnodes must be in [1, 1073741824], got 4294967298"},
      {[](LaunchFlags& f) { f.nnodes = 2, f.node_rank = 2; },
       "--node_rank must be in [0, 1], got 2 (this node's index, below --nnodes=2)"},
      {[](LaunchFlags& f) { f.node_rank = -1; },
       "--node_rank must be in [0, 0], got -1 (this node's index, below --nnodes=1)"},
      {[](LaunchFlags& f) { f.nproc_per_node = 2, f.nnodes = 1 << 30, f.node_rank = 1; },
       "--nnodes x --nproc_per_node = 1073741824 x 2 = 2147483648 ranks, more than the 1073741824 "
       "a job may have (the largest WORLD_SIZE the rendezvous accepts); use fewer nodes or ranks "
       "per node"},
      {[](LaunchFlags& f) { f.master_port = 65536; },
       "--master_port must be in [0, 65535], got 65536 (0 picks one)"},
      {[](LaunchFlags& f) { f.master_port = -1; }, "--master_port must be in [0, 65535], got -1"},
      {[](LaunchFlags& f) { f.max_restarts = 101; }, "--max_restarts must be in [0, 100], got 101"},
      {[](LaunchFlags& f) { f.max_restarts = -1; }, "--max_restarts must be in [0, 100], got -1"},
      {[](LaunchFlags& f) { f.stop_grace_seconds = -1; },
       "--stop_grace_seconds must be in [0, 3600], got -1"},
      {[](LaunchFlags& f) { f.stop_grace_seconds = std::nan(""); },
       "--stop_grace_seconds must be in [0, 3600], got nan"},
      {[](LaunchFlags& f) { f.join_timeout_seconds = 0; },
       "--join_timeout must be in (0, 86400], got 0"},
      {[](LaunchFlags& f) { f.join_timeout_seconds = 1e9; },
       "--join_timeout must be in (0, 86400], got 1e+09"},
      {[](LaunchFlags& f) { f.master_addr.clear(); },
       "--master_addr is empty; give node 0's address or host name (127.0.0.1 on one node)"},
      {[](LaunchFlags& f) { f.rdzv_id = "a b\n"; },
       "--rdzv_id \"a b\\n\" must be 1 to 128 characters from [A-Za-z0-9._-] (or empty: a random "
       "id)"},
      {[](LaunchFlags& f) { f.rdzv_id = std::string(129, 'a'); },
       "must be 1 to 128 characters from [A-Za-z0-9._-]"},
  };
  for (const auto& [change, expected] : cases) {
    LaunchFlags f = launch_values(LaunchOptions());
    change(f);
    const absl::StatusOr<LaunchOptions> o = to_launch_options(f);
    ASSERT_FALSE(o.ok()) << expected;
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << o.status();
    EXPECT_THAT(std::string(o.status().message()), HasSubstr(expected));
    EXPECT_EQ(std::string(o.status().message()).find('\n'), std::string::npos) << o.status();
  }
}

// The largest job fits: 2^30 ranks, every number at its bound.
TEST(LaunchOptionsTest, TheBoundsThemselvesAreAccepted) {
  LaunchFlags f = launch_values(LaunchOptions());
  f.nproc_per_node = 256;
  f.nnodes = int64_t{1} << 22;
  f.node_rank = f.nnodes - 1;
  f.master_port = 65535;
  f.max_restarts = 100;
  f.stop_grace_seconds = 3600;
  f.join_timeout_seconds = 86400;
  f.rdzv_id = std::string(128, 'z');
  absl::StatusOr<LaunchOptions> o = to_launch_options(f);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(int64_t{o->nnodes} * o->nproc_per_node, kMaxWorldSize);
}

// A program's --help lists the flags of the files it accepts: defines_launch_flags accepts the
// file that defines every shared flag, and no other.
TEST(LaunchOptionsTest, DefinesLaunchFlagsNamesTheirFile) {
  for (const char* name :
       {"nnodes", "node_rank", "master_addr", "master_port", "max_restarts", "rdzv_id"}) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    ASSERT_NE(flag, nullptr) << name;
    EXPECT_TRUE(defines_launch_flags(flag->Filename())) << name << ": " << flag->Filename();
  }
  EXPECT_FALSE(defines_launch_flags("launcher/launch.cc"));
  EXPECT_FALSE(defines_launch_flags("examples/train_config.cc"));
}

}  // namespace
}  // namespace dtrain::comm
