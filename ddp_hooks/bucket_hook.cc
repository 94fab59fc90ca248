#include "ddp_hooks/bucket_hook.h"

namespace dtrain::ddp_hooks {

at::Tensor BucketHook::parseHookResult(const c10::IValue& result) {
  if (result.isTensor()) return result.toTensor();
  if (result.isTensorList()) {
    TORCH_CHECK(result.toTensorList().size() > 0, "DDP comm hook result is an empty tensor list");
    return result.toTensorList().get(0);
  }
  if (result.isList()) {
    const auto& list = result.toListRef();
    TORCH_CHECK(!list.empty() && list[0].isTensor(),
                "DDP comm hook result is a list whose first element is not a tensor");
    return list[0].toTensor();
  }
  TORCH_CHECK(false, "DDP comm hook result must be a tensor or a list of tensors, got ",
              result.tagKind());
}

}  // namespace dtrain::ddp_hooks
