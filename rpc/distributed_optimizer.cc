#include "rpc/distributed_optimizer.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dtrain::rpc {
namespace {
std::atomic<int64_t> g_next_optimizer{1};
}

absl::StatusOr<std::unique_ptr<DistributedOptimizer>> DistributedOptimizer::create(
    Agent& agent, const std::string& optimizer, const optim::OptionsDict& options, std::vector<RemoteRef> params) {
  if (params.empty()) return absl::InvalidArgumentError("DistributedOptimizer got an empty parameter list");
  if (!optim::FunctionalRegistry::global().contains(optimizer) && LocalOptimizerRegistry::global().contains(optimizer)) {
    TORCH_WARN("DistributedOptimizer: ", optimizer, " has no functional form; each owner runs the LibTorch ",
               "optimizer itself, through .grad, under its step lock (PyTorch's _LocalOptimizer fallback). ",
               "Register a functional twin (optim/registry.h) for the functional path.");
  }
  std::map<std::string, std::vector<int64_t>> by_owner;
  for (const auto& p : params) by_owner[p.owner].push_back(p.id);
  std::unique_ptr<DistributedOptimizer> opt(
      new DistributedOptimizer(agent, absl::StrCat(agent.name(), "/optimizer", g_next_optimizer.fetch_add(1))));
  try {
    Writer check;
    write_options(check, options);  // an option that cannot travel fails here, once
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(e.what_without_backtrace());
  }
  std::vector<CallFuture> calls;
  for (const auto& [owner, ids] : by_owner) {
    Writer w;
    w.str(opt->key_).str(optimizer);
    write_options(w, options);
    w.i64_list(ids);
    calls.push_back(agent.rpc_async(owner, "dtrain.optim.create", w));
  }
  absl::Status first;
  std::vector<std::string> created;
  size_t k = 0;
  for (const auto& [owner, ids] : by_owner) {
    absl::StatusOr<Response> r = calls[k++].get();
    if (r.ok()) {
      created.push_back(owner);
    } else if (first.ok()) {
      first = absl::Status(r.status().code(),
                           absl::StrCat("DistributedOptimizer: creating ", optimizer, " on '", owner, "' failed: ",
                                        r.status().message()));
    }
  }
  opt->owners_ = created;
  if (!first.ok()) return first;  // the destructor removes those that were created
  return opt;
}

DistributedOptimizer::~DistributedOptimizer() {
  std::vector<CallFuture> calls;
  for (const auto& owner : owners_) calls.push_back(agent_.rpc_async(owner, "dtrain.optim.destroy", Writer().str(key_)));
  for (auto& c : calls) (void)c.get();
}

absl::Status DistributedOptimizer::step(int64_t context_id) {
  const ContextState here = local_context_state(context_id);
  if (here == ContextState::kReleased) {
    return absl::NotFoundError(absl::StrCat("DistributedOptimizer::step: autograd context ", context_id,
                                            " was released; call step(context.id()) while the context is alive"));
  }
  std::vector<CallFuture> calls;
  for (const auto& owner : owners_) {
    calls.push_back(agent_.rpc_async(owner, "dtrain.optim.step", Writer().str(key_).i64(context_id)));
  }
  absl::Status first;
  bool known = false;
  for (auto& c : calls) {
    absl::StatusOr<Response> r = c.get();
    if (r.ok()) {
      try {
        known = r->body.boolean() || known;
      } catch (const CodecError& e) {
        r = absl::DataLossError(absl::StrCat("malformed dtrain.optim.step reply: ", e.what()));
      }
    }
    if (!r.ok() && first.ok()) {
      first = absl::Status(r.status().code(), absl::StrCat("DistributedOptimizer::step on '", c.to(), "' failed: ",
                                                           r.status().message()));
    }
  }
  if (first.ok() && !known && here == ContextState::kUnknown) {
    // Nobody stepped: PyTorch's "Could not find autograd context with id".
    return absl::NotFoundError(absl::StrCat(
        "DistributedOptimizer::step: autograd context ", context_id, " is unknown: it was not created in this ",
        "process and none of the owners (", absl::StrJoin(owners_, ", "), ") has gradients under it; pass the id of ",
        "a live dist_autograd::Context (or GradientContext) after its backward"));
  }
  return first;
}

}  // namespace dtrain::rpc
