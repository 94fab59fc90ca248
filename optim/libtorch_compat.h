// optim/'s LibTorch version layer: the one file in optim/ that depends on which LibTorch it is
// built against (README, "Supported LibTorch"; 1.13 was retired after commit d5a9c1f).
//
// torch::optim::Optimizer::state() is keyed by the parameter's TensorImpl address (`void*`).
// `param_state_key` gives the key, so that callers never spell the key type.
//
//   auto it = optimizer.state().find(dtrain::optim::param_state_key(p));
#ifndef DTRAIN_OPTIM_LIBTORCH_COMPAT_H_
#define DTRAIN_OPTIM_LIBTORCH_COMPAT_H_

#include <ATen/core/Tensor.h>

namespace dtrain::optim {

inline void* param_state_key(const at::Tensor& p) { return p.unsafeGetTensorImpl(); }

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_LIBTORCH_COMPAT_H_
