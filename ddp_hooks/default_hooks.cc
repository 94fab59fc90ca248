#include "ddp_hooks/default_hooks.h"

#include <ATen/ATen.h>

namespace dtrain::ddp {
namespace {

c10::intrusive_ptr<c10::ivalue::Future> ready_future(const at::Tensor& t) {
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  fut->markCompleted(c10::IValue(t));
  return fut;
}

at::Tensor first_tensor(const c10::IValue& result) {
  if (result.isTensor()) return result.toTensor();
  if (result.isTensorList()) return result.toTensorList().get(0);
  if (result.isList()) return result.toListRef()[0].toTensor();
  TORCH_CHECK(false, "DDP comm hook result must be a tensor or a list of tensors, got ", result.tagKind());
}

}  // namespace

c10::intrusive_ptr<c10::ivalue::Future> AllReduceHook::runHook(c10d::GradBucket& bucket) {
  at::Tensor& buffer = bucket.getBufferRef();
  buffer.div_(group_.size());
  std::vector<at::Tensor> t = {buffer};
  return group_->allreduce(t)->getFuture();
}

at::Tensor AllReduceHook::parseHookResult(const c10::IValue& result) { return first_tensor(result); }

CompressHook::CompressHook(comm::Group group, at::ScalarType dtype) : group_(std::move(group)), dtype_(dtype) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "CompressHook compresses to float16 or bfloat16, got ",
              dtype);
}

c10::intrusive_ptr<c10::ivalue::Future> CompressHook::runHook(c10d::GradBucket& bucket) {
  at::Tensor buffer = bucket.getBufferRef();
  at::Tensor compressed = buffer.to(dtype_).div_(group_.size());
  std::vector<at::Tensor> t = {compressed};
  auto fut = group_->allreduce(t)->getFuture();
  // Decompress into the bucket in place, as PyTorch's hook does.
  return fut->then(
      [buffer, compressed](c10::ivalue::Future&) mutable {
        buffer.copy_(compressed);
        return c10::IValue(buffer);
      },
      c10::TensorType::get());
}

at::Tensor CompressHook::parseHookResult(const c10::IValue& result) { return first_tensor(result); }

c10::intrusive_ptr<c10::ivalue::Future> NoOpHook::runHook(c10d::GradBucket& bucket) {
  return ready_future(bucket.getBuffer());
}

at::Tensor NoOpHook::parseHookResult(const c10::IValue& result) { return first_tensor(result); }

}  // namespace dtrain::ddp
