// Internal to comm/: the rendezvous behind init_process_group and rendezvous_store (both declared
// in comm/process_group.h, the user API): env:// / tcp:// / file:// parsing, the store, and every
// rank's arrival checked under one deadline (comm/rendezvous_checks.h).
//
//   absl::StatusOr<internal::Rendezvous> rv = internal::rendezvous(options);
//   if (!rv.ok()) return rv.status();
//   make_pg(options.backend, rv->store, rv->rank, rv->world_size, ..., rv->bind_host, ...);
#ifndef DTRAIN_COMM_INTERNAL_RENDEZVOUS_H_
#define DTRAIN_COMM_INTERNAL_RENDEZVOUS_H_

#include <string>

#include "absl/status/statusor.h"
#include "comm/process_group.h"

namespace dtrain::comm::internal {

struct Rendezvous {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = -1;
  int world_size = -1;
  std::string master;  // host:port or file path, for messages
  std::string bind_host;
};

// The store, this rank and the world size from `options` (its `store`, else its init_method), with
// init_process_group's errors (see comm/process_group.h). REQUIRES options.timeout > 0.
absl::StatusOr<Rendezvous> rendezvous(const InitOptions& options);

// `text` as an integer in [lo, hi]; InvalidArgument naming `what` otherwise.
absl::StatusOr<int> parse_int(const std::string& what, const std::string& text, int lo, int hi);

}  // namespace dtrain::comm::internal

#endif  // DTRAIN_COMM_INTERNAL_RENDEZVOUS_H_
