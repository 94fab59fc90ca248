// Distributed autograd (PyTorch's torch.distributed.autograd) for dtrain's RPC: values fetched
// from their owners inside a Context become local leaves that remember where they came from;
// backward() runs LibTorch autograd here and sends each remote value's gradient to its owner,
// where it is accumulated under the context id for DistributedOptimizer::step.
//
//   dtrain::rpc::dist_autograd::Context ctx(*agent);              // with dist_autograd.context()
//   RemoteRef r1 = *remote(*agent, "worker1", "torch.add", {torch::ones({2}), 3});
//   RemoteRef r2 = *remote(*agent, "worker1", "torch.add", {torch::ones({2}), 1});
//   at::Tensor loss = *to_here(ctx, r1) + *to_here(ctx, r2);
//   absl::Status s = dist_autograd::backward(ctx, {loss.sum()}); // gradients reach worker1
//   auto opt = *DistributedOptimizer::create<torch::optim::SGD>(*agent, SGDOptions(0.05), {r1, r2});
//   s = opt->step(ctx.id());
//
// Sending: one message per owner per backward, carrying all of that owner's gradients, sent
// from a tensor hook as soon as the last of them is computed (while autograd goes on with the
// rest of the graph); backward returns when every owner has acknowledged. Gradients of leaves
// autograd does not reach are not sent. Local leaves that are not remote values (a local
// model's parameters) get their gradients in .grad, as with at::Tensor::backward; the fetched
// copies get theirs too, which nothing uses.
//
// dtrain's own mechanism on top of GradientContext, not LibTorch's DistAutogradContainer: that
// one is wired to PyTorch's own RPC message types (which dtrain's agent does not carry) and
// LibTorch 1.13's packages ship no headers for it.
//
// Thread safety: a Context may be used from several threads (to_here and backward lock it);
// a backward at a time per Context.
#ifndef DTRAIN_RPC_DIST_AUTOGRAD_H_
#define DTRAIN_RPC_DIST_AUTOGRAD_H_

#include <mutex>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rpc/agent.h"
#include "rpc/remote.h"

namespace dtrain::rpc::dist_autograd {

class Context;

// The current value of `ref`, as a new leaf that requires grad and that `ctx` remembers
// (PyTorch's rref.to_here() inside a context). Errors: the fetch's (naming the owner);
// FailedPrecondition on a released context.
absl::StatusOr<at::Tensor> to_here(Context& ctx, const RemoteRef& ref);

// PyTorch's dist_autograd.backward(context_id, roots, retain_graph): runs autograd from `roots`
// (each a defined scalar that requires grad: TORCH_CHECK) and sends every reached remote
// leaf's gradient to its owner, accumulated there under ctx.id() (a second backward adds).
// Errors: FailedPrecondition on a released context; the first owner's error, naming it (a
// dead owner, a released context there). Exceptions from autograd propagate, after every
// gradient already sent has been answered.
absl::Status backward(Context& ctx, const std::vector<at::Tensor>& roots,
                      bool retain_graph = false);

class Context {
 public:
  // A new context with a job-wide unique id.
  explicit Context(Agent& agent) : grads_(agent) {}
  // Releases the context on every owner it sent gradients to (errors ignored).
  ~Context() = default;
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int64_t id() const { return grads_.id(); }
  Agent& agent() const { return grads_.agent(); }
  // The owners drop this context's gradients; step(id()) is then an error naming it.
  absl::Status release() { return grads_.release(); }
  bool released() const { return grads_.released(); }
  // How many fetched values this context remembers.
  size_t num_remote_leaves() const;

 private:
  friend absl::StatusOr<at::Tensor> to_here(Context& ctx, const RemoteRef& ref);
  friend absl::Status backward(Context& ctx, const std::vector<at::Tensor>& roots,
                               bool retain_graph);
  GradientContext grads_;
  mutable std::mutex mu_;  // leaves_
  std::vector<std::pair<at::Tensor, RemoteRef>> leaves_;
};

}  // namespace dtrain::rpc::dist_autograd

#endif  // DTRAIN_RPC_DIST_AUTOGRAD_H_
