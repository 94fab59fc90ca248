// ddp_hooks/'s LibTorch version layer: the one file in ddp_hooks/ that tests LibTorch's version
// (README, "Supported LibTorch").
//
// c10d::GradBucket gained an eighth constructor argument in 2.0 (the sparse gradient's indices,
// std::optional); dense buckets pass none. `make_grad_bucket` takes 1.13's seven arguments and
// builds the bucket on either version.
//
//   c10d::GradBucket b = dtrain::ddp_hooks::make_grad_bucket(0, 1, buffer, offsets, lengths, sizes, params);
//   hook->runHook(b);
#ifndef DTRAIN_DDP_HOOKS_LIBTORCH_COMPAT_H_
#define DTRAIN_DDP_HOOKS_LIBTORCH_COMPAT_H_

#include <cstddef>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/version.h>

namespace dtrain::ddp_hooks {

inline c10d::GradBucket make_grad_bucket(size_t index, size_t bucket_count, at::Tensor buffer,
                                         std::vector<size_t> offsets, std::vector<size_t> lengths,
                                         std::vector<c10::IntArrayRef> sizes, std::vector<at::Tensor> params) {
#if TORCH_VERSION_MAJOR >= 2
  return c10d::GradBucket(index, bucket_count, std::move(buffer), std::move(offsets), std::move(lengths),
                          std::move(sizes), std::move(params), std::nullopt);
#else
  return c10d::GradBucket(index, bucket_count, std::move(buffer), std::move(offsets), std::move(lengths),
                          std::move(sizes), std::move(params));
#endif
}

}  // namespace dtrain::ddp_hooks

#endif  // DTRAIN_DDP_HOOKS_LIBTORCH_COMPAT_H_
