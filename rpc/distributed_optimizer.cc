#include "rpc/distributed_optimizer.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/exception_status.h"
#include "rpc/internal/protocol.h"

namespace dtrain::rpc {
namespace {
std::atomic<int64_t> g_next_optimizer{1};
}

absl::StatusOr<std::unique_ptr<DistributedOptimizer>> DistributedOptimizer::create(
    Agent& agent, const std::string& optimizer, const optim::OptionsDict& options,
    std::vector<RemoteRef> params) {
  if (params.empty())
    return absl::InvalidArgumentError("DistributedOptimizer got an empty parameter list");
  if (!optim::FunctionalRegistry::global().contains(optimizer) &&
      LocalOptimizerRegistry::global().contains(optimizer)) {
    TORCH_WARN("DistributedOptimizer: ", optimizer,
               " has no functional form; each owner runs the LibTorch ",
               "optimizer itself, through .grad, under its step lock (PyTorch's _LocalOptimizer "
               "fallback). ",
               "Register a functional twin (optim/functional/registry.h) for the functional path.");
  }
  std::map<std::string, std::vector<int64_t>> by_owner;
  for (const auto& p : params) by_owner[p.owner].push_back(p.id);
  std::unique_ptr<DistributedOptimizer> opt(new DistributedOptimizer(
      agent, absl::StrCat(agent.name(), "/optimizer", g_next_optimizer.fetch_add(1))));
  try {
    Writer check;
    protocol::write_options(check, options);  // an option that cannot travel fails here, once
  } catch (...) {
    return comm::current_exception_status(absl::StatusCode::kInvalidArgument);
  }
  protocol::FanOut<protocol::OptimCreate> creates(agent);
  for (const auto& [owner, ids] : by_owner)
    creates.send(owner, protocol::OptimCreate{opt->key_, optimizer, options, ids});
  // The destructor removes those that were created when another failed.
  absl::Status s = creates.wait(
      [&](const std::string& owner) {
        return absl::StrCat("DistributedOptimizer: creating ", optimizer, " on '", owner,
                            "' failed: ");
      },
      [&](const std::string& owner, protocol::Done&) { opt->owners_.push_back(owner); });
  if (!s.ok()) return s;
  return opt;
}

absl::StatusOr<std::unique_ptr<DistributedOptimizer>> DistributedOptimizer::create_local(
    Agent& agent, const LocalOptimizerRegistry::TypeEntry& local,
    const torch::optim::OptimizerOptions& options, std::vector<RemoteRef> params) {
  optim::OptionsDict dict = optim::new_options_dict();
  try {
    dict = local.to_dict(options);
  } catch (...) {
    return comm::current_exception_status(absl::StatusCode::kInvalidArgument);
  }
  return create(agent, local.name, dict, std::move(params));
}

DistributedOptimizer::~DistributedOptimizer() {
  protocol::FanOut<protocol::OptimDestroy> destroys(agent_);
  for (const auto& owner : owners_) destroys.send(owner, protocol::OptimDestroy{key_});
  (void)destroys.wait();
}

absl::Status DistributedOptimizer::step(int64_t context_id) {
  const ContextState here = local_context_state(context_id);
  if (here == ContextState::kReleased) {
    return absl::NotFoundError(
        absl::StrCat("DistributedOptimizer::step: autograd context ", context_id,
                     " was released; call step(context.id()) while the context is alive"));
  }
  protocol::FanOut<protocol::OptimStep> steps(agent_);
  for (const auto& owner : owners_) steps.send(owner, protocol::OptimStep{key_, context_id});
  bool known = false;
  const absl::Status first = steps.wait(
      [](const std::string& owner) {
        return absl::StrCat("DistributedOptimizer::step on '", owner, "' failed: ");
      },
      [&](const std::string&, protocol::OptimStep::Result& r) { known = r.stepped || known; });
  if (first.ok() && !known && here == ContextState::kUnknown) {
    // Nobody stepped: PyTorch's "Could not find autograd context with id".
    return absl::NotFoundError(
        absl::StrCat("DistributedOptimizer::step: autograd context ", context_id,
                     " is unknown: it was not created in this ", "process and none of the owners (",
                     absl::StrJoin(owners_, ", "), ") has gradients under it; pass the id of ",
                     "a live dist_autograd::Context (or GradientContext) after its backward"));
  }
  return first;
}

}  // namespace dtrain::rpc
