// The first line a launcher sends node 0's in a multi-node rendezvous (launcher/node_rendezvous.h),
// and node 0's check of it. Private to launcher/.
//
//   HELLO <node_rank> <nproc_per_node> <nnodes> <max_restarts> <rdzv_id>
//
//   internal::Hello job{0, 2, 2, 1, "none"};             // node 0's own settings
//   absl::StatusOr<int> k = internal::admit(line, job);  // the node it joins as, or why not
//
// A refused sender gets one line, "ERROR <why>", and is forgotten: its words never become node 0's
// error (a stranger, another job's launcher, or a misconfigured node all look alike to node 0).
#ifndef DTRAIN_LAUNCHER_INTERNAL_HELLO_H_
#define DTRAIN_LAUNCHER_INTERNAL_HELLO_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dtrain::comm::internal {

struct Hello {
  int node_rank = 0;
  int nproc_per_node = 1;
  int nnodes = 2;
  int max_restarts = 0;
  std::string rdzv_id = "none";
};

// Longest --rdzv_id.
inline constexpr size_t kMaxRdzvIdLength = 128;

// 1 to kMaxRdzvIdLength characters from [A-Za-z0-9._-] (one word on the wire).
bool valid_rdzv_id(absl::string_view id);

std::string hello_line(const Hello& h);

// The node `line` joins as when it is a HELLO that fits `job` (node 0's settings; its node_rank is
// not used), else InvalidArgument with one line saying why, for the ERROR reply and node 0's log:
// not a HELLO, a HELLO without a run id (an older launcher), a node_rank outside [1, nnodes), a
// different rdzv_id, or different nproc_per_node, nnodes or max_restarts. The sender's words are
// escaped and cut short in the reason.
absl::StatusOr<int> admit(const std::string& line, const Hello& job);

}  // namespace dtrain::comm::internal

#endif  // DTRAIN_LAUNCHER_INTERNAL_HELLO_H_
