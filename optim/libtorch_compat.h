// optim/'s LibTorch version layer: the one file in optim/ that tests LibTorch's version
// (README, "Supported LibTorch").
//
// torch::optim::Optimizer::state() is keyed by the parameter's TensorImpl: in 1.13 by its address
// printed as a string, since 2.0 by the address itself (`void*`). `param_state_key` gives the key
// the LibTorch being built against uses.
//
//   auto it = optimizer.state().find(dtrain::optim::param_state_key(p));
#ifndef DTRAIN_OPTIM_LIBTORCH_COMPAT_H_
#define DTRAIN_OPTIM_LIBTORCH_COMPAT_H_

#include <string>

#include <ATen/core/Tensor.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR < 2
#include <c10/util/string_utils.h>
#endif

namespace dtrain::optim {

// PyTorch 1.13's SGD stores momentum_buffer=None in a parameter's state when it has no buffer
// (momentum 0); 2.x stores no state for it. dtrain's state_dict() follows the LibTorch it is
// built against, and load_state_dict() reads either.
inline constexpr bool kSgdStateKeepsNoneMomentumBuffer = TORCH_VERSION_MAJOR < 2;

#if TORCH_VERSION_MAJOR >= 2
inline void* param_state_key(const at::Tensor& p) { return p.unsafeGetTensorImpl(); }
#else
inline std::string param_state_key(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }
#endif

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_LIBTORCH_COMPAT_H_
