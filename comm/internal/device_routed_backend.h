// Internal to comm/: the process group behind backend "cpu:gloo,cuda:nccl" (PyTorch's default
// when CUDA is available): one c10d backend per device type in one group, each collective sent to
// the backend of its tensors' device -- CUDA tensors to NCCL, everything else to Gloo -- as
// c10d::ProcessGroup's dispatcher does. barrier() and the collectives without tensors go to Gloo.
//
//   c10::intrusive_ptr<C10dGroup> pg = internal::make_device_routed(gloo, nccl);
//   pg->allreduce(cpu_tensors);    // Gloo
//   pg->allreduce(cuda_tensors);   // NCCL
//
// Each backend keeps its own order of collectives: every rank must issue, per device type, the
// same collectives in the same order (as with two separate groups). Tensors of one call must share
// a device type (TORCH_CHECK naming both otherwise).
#ifndef DTRAIN_COMM_INTERNAL_DEVICE_ROUTED_BACKEND_H_
#define DTRAIN_COMM_INTERNAL_DEVICE_ROUTED_BACKEND_H_

#include "comm/libtorch_compat.h"

namespace dtrain::comm::internal {

// REQUIRES: both backends of the same rank and size.
c10::intrusive_ptr<C10dGroup> make_device_routed(c10::intrusive_ptr<C10dGroup> cpu,
                                                 c10::intrusive_ptr<C10dGroup> cuda);

}  // namespace dtrain::comm::internal

#endif  // DTRAIN_COMM_INTERNAL_DEVICE_ROUTED_BACKEND_H_
