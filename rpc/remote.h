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
//
// Thread safety: ParameterOwner's handlers run concurrently (one lock for its tables, one that
// serialises optimizer steps on this owner); GradientContext is for one thread.
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

#include "absl/status/statusor.h"
#include "optim/functional_optimizer.h"
#include "rpc/agent.h"

namespace dtrain::rpc {

// A tensor owned by worker `owner` under `id` (PyTorch's RRef: owner + id).
struct RemoteRef {
  std::string owner;
  int64_t id = 0;
};

class ParameterOwner {
 public:
  // Registers the dtrain.param.*, dtrain.grad.* and dtrain.optim.* handlers.
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

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// Asks `owner` to create a parameter initialised from `value` (copied there).
absl::StatusOr<RemoteRef> remote_parameter(Agent& agent, const std::string& owner, const at::Tensor& value);
// The current value of a remote tensor.
absl::StatusOr<at::Tensor> to_here(Agent& agent, const RemoteRef& ref);

class GradientContext {
 public:
  // A job-wide unique id (this worker's rank in the high bits).
  explicit GradientContext(Agent& agent);
  ~GradientContext();  // releases the context on its owners (errors ignored)
  GradientContext(const GradientContext&) = delete;
  GradientContext& operator=(const GradientContext&) = delete;

  int64_t id() const { return id_; }
  // Adds grads[i] to parameter refs[i]'s gradient in this context, all owners in parallel.
  // Undefined gradients are skipped. Errors name the owner (e.g. a shape mismatch there).
  absl::Status send(const std::vector<RemoteRef>& refs, const std::vector<at::Tensor>& grads);
  // Drops this context's gradients on every owner it sent to.
  absl::Status release();

 private:
  Agent& agent_;
  int64_t id_;
  std::set<std::string> owners_;
};

// Encodes / decodes optimizer options (doubles, integers, booleans, strings, pairs of doubles)
// for the wire; None values are left out (the factory's defaults apply).
void write_options(Writer& w, const optim::OptionsDict& options);
optim::OptionsDict read_options(Reader& r);

}  // namespace dtrain::rpc

#endif  // DTRAIN_RPC_REMOTE_H_
