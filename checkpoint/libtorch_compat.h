// checkpoint/'s LibTorch version layer: the one file in checkpoint/ that depends on which LibTorch
// it is built against (docs/libtorch.md).
//
// Named tensors (Tensor::has_names) exist in LibTorch 2.6 and are gone from 2.14's C++ API;
// `has_dimension_names` is their test where they exist and false where they do not, so the
// writer refuses named tensors (as torch.save does) on every version that has them.
//
//   if (dtrain::checkpoint::has_dimension_names(t)) return error("...; rename(None) first");
#ifndef DTRAIN_CHECKPOINT_LIBTORCH_COMPAT_H_
#define DTRAIN_CHECKPOINT_LIBTORCH_COMPAT_H_

#include <ATen/core/Tensor.h>

namespace dtrain::checkpoint {

template <typename T = at::Tensor>
inline bool has_dimension_names(const T& t) {
  if constexpr (requires { t.has_names(); }) {
    return t.has_names();
  } else {
    return false;
  }
}

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_LIBTORCH_COMPAT_H_
