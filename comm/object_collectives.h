// Collectives of arbitrary c10::IValue objects (dicts, lists, strings, tensors...), serialized
// with LibTorch's pickler and sent as length-prefixed byte tensors, as torch.distributed's
// broadcast_object_list / gather_object / all_gather_object.
//
//   c10::IValue obj = group.rank() == 0 ? c10::IValue(std::string("config")) : c10::IValue();
//   absl::Status s = dtrain::comm::broadcast_object(group, obj, /*src=*/0);   // obj on every rank
//   absl::StatusOr<std::vector<c10::IValue>> all = dtrain::comm::all_gather_object(group, mine);
//   absl::StatusOr<std::vector<c10::IValue>> at0 = dtrain::comm::gather_object(group, mine, 0);
//
// All are collectives: every rank of `group` calls them, with the same src/dst. Tensors inside
// objects travel through the pickler (copied); move large tensors with tensor collectives. The
// byte and size tensors live on group.device() (CUDA for NCCL, which refuses CPU tensors).
// Errors: InvalidArgument for a bad src/dst; Internal when an object cannot be (de)serialized;
// Unavailable/DeadlineExceeded when the transport fails or a peer does not arrive in time.
#ifndef DTRAIN_COMM_OBJECT_COLLECTIVES_H_
#define DTRAIN_COMM_OBJECT_COLLECTIVES_H_

#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/process_group.h"

namespace dtrain::comm {

// On `src` (a group rank), sends `obj`; on the other ranks replaces `obj` with src's object.
absl::Status broadcast_object(const Group& group, c10::IValue& obj, int src);

// Returns every rank's object, by group rank.
absl::StatusOr<std::vector<c10::IValue>> all_gather_object(const Group& group,
                                                           const c10::IValue& obj);

// On `dst`, returns every rank's object by group rank; elsewhere an empty vector. Only `dst`
// receives and holds the objects: the other ranks send theirs and keep nothing.
absl::StatusOr<std::vector<c10::IValue>> gather_object(const Group& group, const c10::IValue& obj,
                                                       int dst);

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_OBJECT_COLLECTIVES_H_
