#include "rpc/dist_autograd.h"

#include <exception>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include "absl/strings/str_cat.h"
#include "rpc/internal/protocol.h"

namespace dtrain::rpc::dist_autograd {
namespace {

using torch::autograd::Node;

// The autograd nodes backward from `roots` will run.
std::unordered_set<const Node*> reachable(const std::vector<at::Tensor>& roots) {
  std::unordered_set<const Node*> seen;
  std::vector<Node*> stack;
  auto visit = [&](const torch::autograd::Edge& e) {
    if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
  };
  for (const auto& r : roots) visit(torch::autograd::impl::gradient_edge(r));
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const auto& e : n->next_edges()) visit(e);
  }
  return seen;
}

// One owner's gradients in one backward: sent when the last one expected has arrived.
struct Batch {
  std::vector<int64_t> ids;
  std::vector<at::Tensor> grads;
  size_t pending = 0;
  bool sent = false;
};

// The state the hooks of one backward share.
struct Pass {
  explicit Pass(GradientContext& c) : ctx(c) {}
  std::mutex mu;
  GradientContext& ctx;
  std::map<std::string, Batch> batches;
  std::vector<CallFuture> calls;

  // REQUIRES: mu held.
  void send(const std::string& owner, Batch& b) {
    b.sent = true;
    if (!b.ids.empty()) calls.push_back(ctx.send_async(owner, b.ids, std::move(b.grads)));
  }
};

absl::Status released_error(const char* what, int64_t id) {
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": autograd context ", id, " was released; create a new dist_autograd::Context"));
}

}  // namespace

size_t Context::num_remote_leaves() const {
  std::lock_guard<std::mutex> lock(mu_);
  return leaves_.size();
}

absl::StatusOr<at::Tensor> to_here(Context& ctx, const RemoteRef& ref) {
  if (ctx.released()) return released_error("dist_autograd::to_here", ctx.id());
  absl::StatusOr<at::Tensor> value = rpc::to_here(ctx.agent(), ref);
  if (!value.ok()) return value.status();
  if (!value->is_floating_point() && !value->is_complex()) {
    return absl::InvalidArgumentError(
        absl::StrCat("dist_autograd::to_here: the value ", ref.id, " on '", ref.owner, "' is ",
                     std::string(value->dtype().name()),
                     ", which cannot require grad; fetch it with rpc::to_here"));
  }
  at::Tensor leaf = value->detach().requires_grad_(true);
  std::lock_guard<std::mutex> lock(ctx.mu_);
  ctx.leaves_.emplace_back(leaf, ref);
  return leaf;
}

absl::Status backward(Context& ctx, const std::vector<at::Tensor>& roots, bool retain_graph) {
  TORCH_CHECK(!roots.empty(), "dist_autograd::backward needs at least one root, e.g. {loss.sum()}");
  for (size_t i = 0; i < roots.size(); ++i) {
    TORCH_CHECK(
        roots[i].defined() && roots[i].requires_grad() && roots[i].numel() == 1,
        "dist_autograd::backward: root ", i, " must be a scalar that requires grad, got ",
        roots[i].defined()
            ? absl::StrCat("a tensor of ", roots[i].numel(), " elements",
                           roots[i].requires_grad() ? "" : " that does not require grad")
            : std::string("an undefined tensor"),
        "; reduce it first (loss.sum()) and compute it from values of dist_autograd::to_here");
  }
  if (ctx.released()) return released_error("dist_autograd::backward", ctx.id());
  std::vector<std::pair<at::Tensor, RemoteRef>> leaves;
  {
    std::lock_guard<std::mutex> lock(ctx.mu_);
    leaves = ctx.leaves_;
  }
  const std::unordered_set<const Node*> reached = reachable(roots);
  auto pass = std::make_shared<Pass>(ctx.grads_);
  std::vector<std::pair<at::Tensor, unsigned>> hooks;
  for (const auto& [leaf, ref] : leaves) {
    // std::shared_ptr (2.6) or c10::intrusive_ptr (2.14, 2.15): only get() is used.
    const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(leaf);
    if (accumulator == nullptr || reached.count(accumulator.get()) == 0)
      continue;  // no gradient this time
    ++pass->batches[ref.owner].pending;
    // A leaf's hook sees its whole gradient, once per backward. The handle kept here stops
    // AccumulateGrad from taking this tensor over as .grad (it copies), so nothing changes it
    // while TensorPipe sends it.
    hooks.emplace_back(
        leaf, leaf.register_hook([pass, owner = ref.owner, id = ref.id](const at::Tensor& grad) {
          std::lock_guard<std::mutex> lock(pass->mu);
          Batch& b = pass->batches[owner];
          if (grad.defined()) {
            b.ids.push_back(id);
            b.grads.push_back(grad);
          }
          if (--b.pending == 0 && !b.sent) pass->send(owner, b);
        }));
  }
  std::exception_ptr error;
  try {
    torch::autograd::backward(roots, {}, retain_graph);
  } catch (...) {
    error = std::current_exception();
  }
  for (auto& [leaf, handle] : hooks) leaf.remove_hook(handle);
  protocol::FanOut<protocol::GradPush> pushes(ctx.agent());
  {
    std::lock_guard<std::mutex> lock(pass->mu);
    if (!error) {
      // Leaves whose hook did not run (an undefined gradient on every path): what arrived.
      for (auto& [owner, b] : pass->batches) {
        if (!b.sent) pass->send(owner, b);
      }
    }
    for (CallFuture& c : pass->calls) pushes.add(std::move(c));
    pass->calls.clear();
  }
  const absl::Status first = pushes.wait([&](const std::string& owner) {
    return absl::StrCat("dist_autograd::backward: sending gradients of context ", ctx.id(), " to '",
                        owner, "' failed: ");
  });
  if (error) std::rethrow_exception(error);
  return first;
}

}  // namespace dtrain::rpc::dist_autograd
