// The base of dtrain's DDP communication hooks: c10d::CommHookInterface with the one
// parseHookResult every hook shares, and a base for hooks whose state the caller keeps.
//
//   class MyHook : public dtrain::ddp_hooks::StatefulHook<MyState> {
//    public:
//     explicit MyHook(std::shared_ptr<MyState> s) : StatefulHook(std::move(s), "MyHook") {}
//     c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
//   };
//
// A hook's future may complete with the reduced bucket as a tensor or as a list of tensors (what a
// process group's work future carries); parseHookResult returns the tensor, or the list's first.
// Why not c10d's CppCommHookInterface<T>: it holds its state by value, where dtrain's hooks share
// theirs with the caller (StatefulHook: a shared_ptr, and a name for messages); DDP calls the same
// c10d::CommHookInterface either way.
#ifndef DTRAIN_DDP_HOOKS_BUCKET_HOOK_H_
#define DTRAIN_DDP_HOOKS_BUCKET_HOOK_H_

#include <memory>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

namespace dtrain::ddp_hooks {

class BucketHook : public c10d::CommHookInterface {
 public:
  // The reduced bucket: `result` itself when it is a tensor, else the first tensor of the list.
  // TORCH_CHECKs that it is one of the two.
  at::Tensor parseHookResult(const c10::IValue& result) override;
};

// A hook over shared state the caller keeps (to read counters, change settings between steps or
// checkpoint it). TORCH_CHECKs that `state` is set, naming `hook_name`.
template <typename State>
class StatefulHook : public BucketHook {
 public:
  StatefulHook(std::shared_ptr<State> state, const char* hook_name) : state_(std::move(state)) {
    TORCH_CHECK(state_ != nullptr, hook_name, " needs a state: pass std::make_shared<State>(...)");
  }

 protected:
  State& state() const { return *state_; }

 private:
  std::shared_ptr<State> state_;
};

}  // namespace dtrain::ddp_hooks

#endif  // DTRAIN_DDP_HOOKS_BUCKET_HOOK_H_
