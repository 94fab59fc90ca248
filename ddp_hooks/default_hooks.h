// DDP communication hooks on c10d's own hook interface (c10d::CommHookInterface, GradBucket from
// c10d/comm.hpp), so hooks written for PyTorch's C++ reducer port over. Each receives a bucket
// (one flat gradient buffer) and returns a future of the reduced buffer.
//
//   ddp.register_comm_hook(std::make_unique<dtrain::ddp::AllReduceHook>(group));      // the default
//   ddp.register_comm_hook(std::make_unique<dtrain::ddp::CompressHook>(group, at::kHalf));  // fp16
//   ddp.register_comm_hook(std::make_unique<dtrain::ddp::NoOpHook>());                // headroom
#ifndef DTRAIN_DDP_HOOKS_DEFAULT_HOOKS_H_
#define DTRAIN_DDP_HOOKS_DEFAULT_HOOKS_H_

#include <torch/csrc/distributed/c10d/comm.hpp>

#include "comm/process_group.h"

namespace dtrain::ddp {

// PyTorch's allreduce_hook: divide by the world size, then all-reduce (sum).
class AllReduceHook : public c10d::CommHookInterface {
 public:
  explicit AllReduceHook(comm::Group group) : group_(std::move(group)) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override;

 private:
  comm::Group group_;
};

// PyTorch's fp16_compress_hook / bf16_compress_hook: cast the bucket to `dtype` (kHalf or
// kBFloat16), divide, all-reduce, and cast back into the bucket in place.
class CompressHook : public c10d::CommHookInterface {
 public:
  CompressHook(comm::Group group, at::ScalarType dtype);
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override;

 private:
  comm::Group group_;
  at::ScalarType dtype_;
};

// PyTorch's noop_hook: no communication (to measure how much headroom communication leaves).
class NoOpHook : public c10d::CommHookInterface {
 public:
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override;
};

}  // namespace dtrain::ddp

#endif  // DTRAIN_DDP_HOOKS_DEFAULT_HOOKS_H_
