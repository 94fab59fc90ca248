// The agreements collective constructors and multi-rank saves need, in one place: "is everyone's
// view the same?" (check_identical: gather a description and compare, naming the first
// difference), "rank R decided; everyone act on it" (share_verdict: one rank's Status reaches
// every rank) and "did every rank succeed?" (first_failure), so that all ranks fail together
// instead of some hanging in the next collective.
//
//   std::vector<std::string> mine = {describe(param0), describe(param1)};
//   absl::Status same = dtrain::comm::check_identical(group, mine, "parameter");
//   // on every rank: OK, or "parameter 1 is fc.bias Float [5] on rank 1 but fc.bias Float [3] on rank 0"
//
//   absl::Status verdict = group.rank() == 0 ? validate_everything() : absl::OkStatus();
//   verdict = dtrain::comm::share_verdict(group, verdict, /*root=*/0);   // rank 0's, everywhere
//
//   absl::Status wrote = save_my_part();
//   absl::Status all = dtrain::comm::first_failure(group, wrote);
//   // OK on every rank, or: this rank's own error, or Aborted "rank 2 failed" on the others
//
// Both are collectives: every rank of `group` calls them in the same order. Transport failures
// come back as object_collectives.h's errors (Unavailable, DeadlineExceeded).
#ifndef DTRAIN_COMM_AGREEMENT_H_
#define DTRAIN_COMM_AGREEMENT_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "comm/process_group.h"

namespace dtrain::comm {

// OK when every rank passed the same `items` as rank 0; else, on every rank, InvalidArgument
// "<label> <i> is <item on rank r> on rank <r> but <item on rank 0> on rank 0" for the lowest
// such rank and index ("(none)" where one list is shorter).
absl::Status check_identical(const Group& group, const std::vector<std::string>& items,
                             std::string_view label);

// Returns `root`'s `verdict` (its code and message, or OK) on every rank; the other ranks'
// `verdict` arguments are ignored. REQUIRES: 0 <= root < group.size().
absl::Status share_verdict(const Group& group, const absl::Status& verdict, int root);

// Whether every rank's `mine` is OK: OK everywhere when they all are; else a failed rank gets its
// own `mine` back and every other rank Aborted "rank <R> failed" naming the lowest failed rank
// (its own error says why). One all-reduce of an integer on the group's device. A transport
// failure is Unavailable with the collective's error.
absl::Status first_failure(const Group& group, const absl::Status& mine);

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_AGREEMENT_H_
