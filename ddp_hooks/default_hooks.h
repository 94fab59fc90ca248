// DDP communication hooks on c10d's own hook interface (c10d::CommHookInterface, GradBucket from
// c10d/comm.hpp), so hooks written for PyTorch's C++ reducer port over. Each receives a bucket
// (one flat gradient buffer) and returns a future of the reduced buffer.
//
//   ddp.register_comm_hook(std::make_unique<dtrain::ddp_hooks::AllReduceHook>(group));      // the default
//   ddp.register_comm_hook(std::make_unique<dtrain::ddp_hooks::CompressHook>(group, at::kHalf));  // fp16
//   ddp.register_comm_hook(std::make_unique<dtrain::ddp_hooks::NoOpHook>());                // headroom
#ifndef DTRAIN_DDP_HOOKS_DEFAULT_HOOKS_H_
#define DTRAIN_DDP_HOOKS_DEFAULT_HOOKS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include <torch/csrc/distributed/c10d/comm.hpp>

#include "comm/process_group.h"
#include "ddp_hooks/bucket_hook.h"

namespace dtrain::ddp_hooks {

// Whether this process's Gloo all-reduces tensors of `dtype`. Debian sid's LibTorch 2.14 Gloo
// reduces neither float16 nor bfloat16 ("Invalid scalar type"; PyTorch's fp16 hook fails there
// too); 2.6's and pytorch.org's do. Probed once per dtype on a private one-rank Gloo group, so no
// rank waits for another.
bool gloo_reduces(at::ScalarType dtype);

// The sum of `t` over `group`, in place in t: an all-reduce, or where Gloo cannot reduce t's dtype
// (gloo_reduces), an all-gather of every rank's values summed here in float32 and rounded once
// into t's dtype. The future's value holds t; its error is the collective's.
c10::intrusive_ptr<c10::ivalue::Future> allreduce_sum(const comm::Group& group,
                                                      const at::Tensor& t);

// PyTorch's allreduce_hook: divide by the world size, then all-reduce (sum).
class AllReduceHook : public BucketHook {
 public:
  explicit AllReduceHook(comm::Group group) : group_(std::move(group)) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;

 private:
  comm::Group group_;
};

// PyTorch's fp16_compress_hook / bf16_compress_hook: cast the bucket to `dtype` (kHalf or
// kBFloat16), divide, all-reduce, and cast back into the bucket in place.
//
// On CPU the compressed copy of each bucket is kept between iterations and written again in
// place (PyTorch allocates a fresh one per call): a fresh 10+ MiB tensor per bucket per
// iteration is memory glibc may hand back to the kernel and fault in again, which made the bf16
// hook slower than PyTorch's in some runs of //ddp_hooks:hooks_benchmark. A kept copy is reused
// only once the previous call's all-reduce and decompression are done; otherwise (a call for the
// same bucket while the last one is still in flight) a new one is made. The values are the same
// either way (copy_ into bf16 is the cast `to` does).
class CompressHook : public BucketHook {
 public:
  CompressHook(comm::Group group, at::ScalarType dtype);
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;

  // How many compressed buffers this hook has allocated so far (observability and tests): on
  // CPU, one per bucket over any number of iterations while bucket sizes stay the same.
  int64_t buffers_allocated() const;

 private:
  struct Kept {
    at::Tensor tensor;
    std::shared_ptr<std::atomic<bool>> done;  // set once the call that used `tensor` is finished
  };
  // A dtype_ tensor of `buffer`'s shape for bucket `index` (the kept one when idle), with the
  // flag the caller sets once it no longer uses it.
  Kept acquire(const at::Tensor& buffer, size_t index);

  comm::Group group_;
  at::ScalarType dtype_;
  mutable std::mutex mu_;
  std::vector<Kept> kept_;  // by bucket index; CPU only
  int64_t allocated_ = 0;
};

// PyTorch's fp16_compress_wrapper / bf16_compress_wrapper: runs `inner` on a copy of the bucket
// cast to `dtype`, then writes the result back into the original bucket in its own dtype. Wraps
// any hook (e.g. PowerSGD, which then works on half-precision matrices).
class CompressWrapper : public BucketHook {
 public:
  CompressWrapper(std::unique_ptr<c10d::CommHookInterface> inner, at::ScalarType dtype);
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;

 private:
  std::unique_ptr<c10d::CommHookInterface> inner_;
  at::ScalarType dtype_;
};

// PyTorch's post_localSGD_hook state: all-reduce globally for the first start_localSGD_iter
// iterations, then only within `subgroup` (or not at all without post_local_gradient_allreduce);
// a PostLocalSGDOptimizer then averages parameters globally every few steps.
struct PostLocalSGDState {
  PostLocalSGDState(comm::Group process_group, comm::Group subgroup, int64_t start_localSGD_iter,
                    bool post_local_gradient_allreduce = true);
  comm::Group process_group;
  // The local group (e.g. the ranks of one node). If left empty, subgroups of LOCAL_WORLD_SIZE
  // consecutive ranks (torchrun sets it) are created when local SGD starts.
  comm::Group subgroup;
  int64_t start_localSGD_iter;
  bool post_local_gradient_allreduce;
  int64_t iter = 0;
};

class PostLocalSGDHook : public StatefulHook<PostLocalSGDState> {
 public:
  explicit PostLocalSGDHook(std::shared_ptr<PostLocalSGDState> state);
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
};

// PyTorch's noop_hook: no communication (to measure how much headroom communication leaves).
class NoOpHook : public BucketHook {
 public:
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
};

}  // namespace dtrain::ddp_hooks

#endif  // DTRAIN_DDP_HOOKS_DEFAULT_HOOKS_H_
