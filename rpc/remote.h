// Remote parameters and gradient contexts: what torch.distributed.rpc's RRefs and distributed
// autograd give the RPC DistributedOptimizer, done explicitly. Every worker runs a
// ParameterOwner; a RemoteRef names a tensor it owns; trainers fetch parameters (to_here),
// compute gradients locally with LibTorch autograd and send them to the owners under a
// GradientContext id. Owners accumulate per context and per parameter, never into .grad.
//
//   auto handlers = std::make_shared<dtrain::rpc::Handlers>();
//   dtrain::rpc::ParameterOwner owner(handlers);            // before Agent::create
//   ... agent = Agent::create({.name = ..., .handlers = handlers}) ...
//   RemoteRef w = *remote_parameter(*agent, "ps0", at::randn({10, 10}));   // owned by ps0
//   at::Tensor local = to_here(*agent, w)->requires_grad_();
//   loss(local).backward();
//   GradientContext ctx(*agent);
//   ctx.send({w}, {local.grad()});                           // accumulated on ps0 under ctx.id()
//   ... DistributedOptimizer::step(ctx.id()) ...
//   ctx.release();                                           // owners drop the context
//   RemoteRef r = *remote(*agent, "ps0", "torch.add", {at::ones({2}), 3});   // rpc.remote
//
// rpc/dist_autograd.h sends the gradients by itself (PyTorch's dist_autograd); this is the
// explicit layer under it.
//
// Thread safety: ParameterOwner's handlers run concurrently (one lock for its tables, one that
// serialises optimizer steps on this owner); GradientContext's methods are thread-safe.
#ifndef DTRAIN_RPC_REMOTE_H_
#define DTRAIN_RPC_REMOTE_H_

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "optim/functional/optimizer.h"
#include "rpc/agent.h"

namespace dtrain::rpc {

// A tensor owned by worker `owner` under `id` (PyTorch's RRef: owner + id).
struct RemoteRef {
  std::string owner;
  int64_t id = 0;
};

class ParameterOwner {
 public:
  // Registers the handlers of the dtrain.param.*, dtrain.grad.*, dtrain.fn.* and dtrain.optim.*
  // messages (rpc/internal/protocol.h).
  explicit ParameterOwner(std::shared_ptr<Handlers> handlers);
  ~ParameterOwner();

  // Makes a local tensor remotely reachable (the tensor itself, not a copy): the owner's
  // optimizer updates it in place.
  RemoteRef own(const std::string& self_name, at::Tensor tensor);
  at::Tensor local(int64_t id) const;
  // The accumulated gradient of parameter `id` in `context`, if any (for inspection).
  std::optional<at::Tensor> grad(int64_t context, int64_t id) const;
  size_t num_contexts() const;
  size_t num_optimizers() const;
  // dtrain.grad.push messages received so far (each carries one or more gradients).
  int64_t num_gradient_messages() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// Asks `owner` to create a parameter initialised from `value` (copied there).
absl::StatusOr<RemoteRef> remote_parameter(Agent& agent, const std::string& owner,
                                           const at::Tensor& value);
// The current value of a remote tensor.
absl::StatusOr<at::Tensor> to_here(Agent& agent, const RemoteRef& ref);
// PyTorch's rpc.remote(worker, fn, args): runs the function registered as `fn` on `worker`
// (rpc/functions.h; no code travels) and keeps its result there, owned by that worker's
// ParameterOwner: usable with to_here and as a DistributedOptimizer parameter. Errors:
// InvalidArgument for an argument that cannot travel; the worker's error, naming it and the
// function, for an unknown function or arguments it refuses.
absl::StatusOr<RemoteRef> remote(Agent& agent, const std::string& worker, const std::string& fn,
                                 const std::vector<c10::IValue>& args = {});

// Where a context id stands in this process: created here and not yet released, released here,
// or never created here (another worker's id, or no context at all).
enum class ContextState { kLive, kReleased, kUnknown };
ContextState local_context_state(int64_t context_id);

class GradientContext {
 public:
  // A job-wide unique id (this worker's rank in the high bits).
  explicit GradientContext(Agent& agent);
  ~GradientContext();  // releases the context on its owners (errors ignored)
  GradientContext(const GradientContext&) = delete;
  GradientContext& operator=(const GradientContext&) = delete;

  int64_t id() const { return id_; }
  Agent& agent() const { return agent_; }
  // Adds grads[i] to parameter refs[i]'s gradient in this context, all owners in parallel.
  // Undefined gradients are skipped. Errors name the owner (e.g. a shape mismatch there);
  // FailedPrecondition after release().
  absl::Status send(const std::vector<RemoteRef>& refs, const std::vector<at::Tensor>& grads);
  // One message to `owner` with the gradients of its parameters `ids`, not waited for.
  CallFuture send_async(const std::string& owner, const std::vector<int64_t>& ids,
                        std::vector<at::Tensor> grads);
  // Drops this context's gradients on every owner it sent to. Final: the id is then unknown to
  // send() and DistributedOptimizer::step (an error naming it), as a released PyTorch context.
  absl::Status release();
  bool released() const;

 private:
  Agent& agent_;
  int64_t id_;
  mutable std::mutex mu_;  // owners_, released_
  std::set<std::string> owners_;
  bool released_ = false;
};

}  // namespace dtrain::rpc

#endif  // DTRAIN_RPC_REMOTE_H_
