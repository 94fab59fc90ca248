// ddp_hooks/'s LibTorch version layer: the one file in ddp_hooks/ that depends on which LibTorch
// it is built against (docs/libtorch.md).
//
// `make_grad_bucket` builds a dense c10d::GradBucket (its constructor's eighth argument, the
// sparse gradient's indices, is none). `GradAccumulatorPtr` is how autograd owns a parameter's
// gradient accumulator, which changed between the supported versions.
//
//   c10d::GradBucket b = dtrain::ddp_hooks::make_grad_bucket(0, 1, buffer, offsets, lengths, sizes, params);
//   hook->runHook(b);
#ifndef DTRAIN_DDP_HOOKS_LIBTORCH_COMPAT_H_
#define DTRAIN_DDP_HOOKS_LIBTORCH_COMPAT_H_

#include <cstddef>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

namespace dtrain::ddp_hooks {

// The owning pointer to a parameter's gradient accumulator (the autograd node DDP hooks into):
// std::shared_ptr<Node> up to LibTorch 2.6, c10::intrusive_ptr<Node> in 2.14.
using GradAccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

inline c10d::GradBucket make_grad_bucket(size_t index, size_t bucket_count, at::Tensor buffer,
                                         std::vector<size_t> offsets, std::vector<size_t> lengths,
                                         std::vector<c10::IntArrayRef> sizes,
                                         std::vector<at::Tensor> params) {
  return c10d::GradBucket(index, bucket_count, std::move(buffer), std::move(offsets),
                          std::move(lengths), std::move(sizes), std::move(params), std::nullopt);
}

}  // namespace dtrain::ddp_hooks

#endif  // DTRAIN_DDP_HOOKS_LIBTORCH_COMPAT_H_
