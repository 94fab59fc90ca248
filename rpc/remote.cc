#include "rpc/remote.h"

#include <atomic>
#include <deque>

#include <c10/core/GradMode.h>

#include "absl/strings/str_cat.h"
#include "comm/exception_status.h"
#include "optim/functional/registry.h"
#include "rpc/functions.h"
#include "rpc/internal/protocol.h"
#include "rpc/local_optimizers.h"

namespace dtrain::rpc {
namespace pr = protocol;

struct ParameterOwner::State {
  struct LocalOptimizer {
    std::unique_ptr<optim::FunctionalOptimizer> optimizer;
    // Instead of `optimizer`: a LibTorch optimizer with no functional form, stepped through .grad.
    std::unique_ptr<torch::optim::Optimizer> torch_optimizer;
    std::vector<at::Tensor> params;
    std::vector<int64_t> ids;
  };
  mutable std::mutex mu;  // the tables below
  std::map<int64_t, at::Tensor> params;
  std::map<int64_t, std::map<int64_t, at::Tensor>> contexts;  // context -> parameter -> gradient
  // The last kMaxReleased contexts released here: a step or a push under one is an error.
  std::set<int64_t> released;
  std::deque<int64_t> released_order;
  int64_t gradient_messages = 0;
  std::map<std::string, std::shared_ptr<LocalOptimizer>> optimizers;
  int64_t next_id = 1;
  // Optimizer steps on this owner run one at a time (PyTorch's _LocalOptimizer.global_lock):
  // concurrent steps from several clients never interleave on a parameter.
  std::mutex step_mu;

  at::Tensor param(int64_t id) const {
    std::lock_guard<std::mutex> lock(mu);
    auto it = params.find(id);
    TORCH_CHECK(it != params.end(), "no parameter with id ", id, " on this worker");
    return it->second;
  }
  int64_t add(at::Tensor t) {
    std::lock_guard<std::mutex> lock(mu);
    params[next_id] = std::move(t);
    return next_id++;
  }
};

namespace {

constexpr size_t kMaxReleased = 4096;

void check_not_released(const ParameterOwner::State& s, int64_t context, const char* what) {
  TORCH_CHECK(s.released.count(context) == 0, what, ": autograd context ", context,
              " was released on this worker; use a live context (step before releasing it)");
}

// Contexts created in this process: live ones, and the last kMaxReleased released ones.
struct ContextTable {
  std::mutex mu;
  std::set<int64_t> live, released;
  std::deque<int64_t> released_order;
};
ContextTable& contexts() {
  static ContextTable* table = new ContextTable();
  return *table;
}

// Steps a LibTorch optimizer with `grads` as the parameters' .grad for the step (undefined:
// the parameter is skipped, as LibTorch's optimizers skip a parameter with no .grad); the
// .grad each had before is put back, also when the step throws.
void step_through_grad(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& params,
                       const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> saved;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor p = params[i];
    saved.push_back(p.grad());
    p.mutable_grad() = grads[i];
  }
  auto restore = [&] {
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor p = params[i];
      p.mutable_grad() = saved[i];
    }
  };
  try {
    optimizer.step();
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

}  // namespace

ContextState local_context_state(int64_t context_id) {
  ContextTable& t = contexts();
  std::lock_guard<std::mutex> lock(t.mu);
  if (t.live.count(context_id)) return ContextState::kLive;
  if (t.released.count(context_id)) return ContextState::kReleased;
  return ContextState::kUnknown;
}

namespace {

using State = ParameterOwner::State;

// The handlers, one per message of rpc/internal/protocol.h. They run concurrently on the
// agent's threads; errors are exceptions (TORCH_CHECK), which the agent replies with.

pr::ParamCreate::Result param_create(State& s, pr::ParamCreate& m) {
  return {s.add(m.value.detach().clone())};
}

pr::ParamFetch::Result param_fetch(State& s, pr::ParamFetch& m) {
  // A snapshot: the caller must not see a step half-applied.
  std::lock_guard<std::mutex> step(s.step_mu);
  return {s.param(m.id).detach().clone()};
}

pr::Done grad_push(State& s, pr::GradPush& m) {
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < m.ids.size(); ++i) {
    params.push_back(s.param(m.ids[i]));
    const at::Tensor& g = m.grads[i];
    TORCH_CHECK(g.sizes().equals(params[i].sizes()) && g.dtype() == params[i].dtype(),
                "gradient for parameter ", m.ids[i], " has shape ", g.sizes(), " (", g.dtype(),
                ") but the parameter is ", params[i].sizes(), " (", params[i].dtype(), ")");
  }
  std::lock_guard<std::mutex> lock(s.mu);
  check_not_released(s, m.context, pr::GradPush::kName);
  ++s.gradient_messages;
  auto& grads = s.contexts[m.context];
  for (size_t i = 0; i < m.ids.size(); ++i) {
    auto it = grads.find(m.ids[i]);
    if (it == grads.end()) {
      grads[m.ids[i]] = m.grads[i].detach().clone();
    } else {
      it->second.add_(m.grads[i]);
    }
  }
  return {};
}

pr::Done grad_release(State& s, pr::GradRelease& m) {
  std::lock_guard<std::mutex> lock(s.mu);
  s.contexts.erase(m.context);
  if (s.released.insert(m.context).second) {
    s.released_order.push_back(m.context);
    if (s.released_order.size() > kMaxReleased) {
      s.released.erase(s.released_order.front());
      s.released_order.pop_front();
    }
  }
  return {};
}

pr::FnRemote::Result fn_remote(State& s, pr::FnRemote& m) {
  at::Tensor value;
  {
    c10::NoGradGuard no_grad;  // the value is kept, not a node of some graph
    value = FunctionRegistry::global().call(m.fn, m.args).detach();
  }
  return {s.add(std::move(value))};
}

pr::Done optim_create(State& s, pr::OptimCreate& m) {
  auto local = std::make_shared<State::LocalOptimizer>();
  std::vector<at::Tensor> params;
  for (int64_t id : m.ids) params.push_back(s.param(id));
  if (!optim::FunctionalRegistry::global().contains(m.optimizer) &&
      LocalOptimizerRegistry::global().contains(m.optimizer)) {
    local->torch_optimizer =
        LocalOptimizerRegistry::global().create(m.optimizer, params, m.options);
  } else {
    local->optimizer = optim::FunctionalRegistry::global().create(m.optimizer, params, m.options);
  }
  local->params = std::move(params);
  local->ids = m.ids;
  std::lock_guard<std::mutex> lock(s.mu);
  TORCH_CHECK(s.optimizers.count(m.key) == 0, "an optimizer named ", m.key, " already exists here");
  s.optimizers[m.key] = std::move(local);
  return {};
}

pr::OptimStep::Result optim_step(State& s, pr::OptimStep& m) {
  std::lock_guard<std::mutex> step(s.step_mu);
  std::shared_ptr<State::LocalOptimizer> local;
  std::vector<at::Tensor> grads;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.optimizers.find(m.key);
    TORCH_CHECK(it != s.optimizers.end(), "no optimizer named ", m.key,
                " here (created? destroyed?)");
    local = it->second;
    check_not_released(s, m.context, "DistributedOptimizer::step");
    auto ctx = s.contexts.find(m.context);
    // Unknown here: no gradient came under this context, nothing to do; the caller decides
    // whether that is an error (reply false).
    if (ctx == s.contexts.end()) return {false};
    for (int64_t id : local->ids) {
      at::Tensor g;
      auto git = ctx->second.find(id);
      if (git != ctx->second.end()) g = git->second;
      grads.push_back(g);  // undefined: this parameter is left untouched
    }
  }
  c10::NoGradGuard no_grad;
  if (local->optimizer) {
    local->optimizer->step(grads);
  } else {
    step_through_grad(*local->torch_optimizer, local->params, grads);
  }
  return {true};
}

pr::Done optim_destroy(State& s, pr::OptimDestroy& m) {
  std::lock_guard<std::mutex> step(s.step_mu);
  std::lock_guard<std::mutex> lock(s.mu);
  s.optimizers.erase(m.key);
  return {};
}

// Serves M with `fn` for as long as the ParameterOwner lives.
template <typename M>
void serve(Handlers& handlers, const std::weak_ptr<State>& weak,
           typename M::Result (*fn)(State&, M&)) {
  pr::serve<M>(handlers, [weak, fn](M& m) {
    std::shared_ptr<State> s = weak.lock();
    TORCH_CHECK(s != nullptr, M::kName, ": this worker's ParameterOwner is gone");
    return fn(*s, m);
  });
}

}  // namespace

ParameterOwner::ParameterOwner(std::shared_ptr<Handlers> handlers)
    : state_(std::make_shared<State>()) {
  TORCH_CHECK(handlers != nullptr, "ParameterOwner needs the Handlers the agent will serve");
  Handlers& h = *handlers;
  serve<pr::ParamCreate>(h, state_, &param_create);
  serve<pr::ParamFetch>(h, state_, &param_fetch);
  serve<pr::GradPush>(h, state_, &grad_push);
  serve<pr::GradRelease>(h, state_, &grad_release);
  serve<pr::FnRemote>(h, state_, &fn_remote);
  serve<pr::OptimCreate>(h, state_, &optim_create);
  serve<pr::OptimStep>(h, state_, &optim_step);
  serve<pr::OptimDestroy>(h, state_, &optim_destroy);
}

ParameterOwner::~ParameterOwner() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->contexts.clear();
  state_->optimizers.clear();
}

RemoteRef ParameterOwner::own(const std::string& self_name, at::Tensor tensor) {
  return RemoteRef{self_name, state_->add(std::move(tensor))};
}

at::Tensor ParameterOwner::local(int64_t id) const { return state_->param(id); }

std::optional<at::Tensor> ParameterOwner::grad(int64_t context, int64_t id) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  auto c = state_->contexts.find(context);
  if (c == state_->contexts.end()) return std::nullopt;
  auto g = c->second.find(id);
  if (g == c->second.end()) return std::nullopt;
  return g->second;
}

size_t ParameterOwner::num_contexts() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->contexts.size();
}

int64_t ParameterOwner::num_gradient_messages() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->gradient_messages;
}

size_t ParameterOwner::num_optimizers() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->optimizers.size();
}

absl::StatusOr<RemoteRef> remote_parameter(Agent& agent, const std::string& owner,
                                           const at::Tensor& value) {
  absl::StatusOr<pr::ParamCreate::Result> r =
      pr::call_sync(agent, owner, pr::ParamCreate{value.detach()});
  if (!r.ok()) return r.status();
  return RemoteRef{owner, r->id};
}

absl::StatusOr<at::Tensor> to_here(Agent& agent, const RemoteRef& ref) {
  absl::StatusOr<pr::ParamFetch::Result> r =
      pr::call_sync(agent, ref.owner, pr::ParamFetch{ref.id});
  if (!r.ok()) return r.status();
  return std::move(r->value);
}

absl::StatusOr<RemoteRef> remote(Agent& agent, const std::string& worker, const std::string& fn,
                                 const std::vector<c10::IValue>& args) {
  std::optional<CallFuture> call;
  try {
    call = pr::send(agent, worker, pr::FnRemote{fn, args});  // encoding refuses what cannot travel
  } catch (...) {
    return comm::current_exception_status(absl::StatusCode::kInvalidArgument,
                                          absl::StrCat("remote(", worker, ", ", fn, ")"));
  }
  absl::StatusOr<pr::FnRemote::Result> r = pr::result_of<pr::FnRemote>(*call);
  if (!r.ok()) return r.status();
  return RemoteRef{worker, r->id};
}

namespace {
std::atomic<int64_t> g_next_context{1};
}

GradientContext::GradientContext(Agent& agent)
    : agent_(agent), id_((static_cast<int64_t>(agent.rank()) << 40) | g_next_context.fetch_add(1)) {
  ContextTable& t = contexts();
  std::lock_guard<std::mutex> lock(t.mu);
  t.live.insert(id_);
}

GradientContext::~GradientContext() { (void)release(); }

bool GradientContext::released() const {
  std::lock_guard<std::mutex> lock(mu_);
  return released_;
}

CallFuture GradientContext::send_async(const std::string& owner, const std::vector<int64_t>& ids,
                                       std::vector<at::Tensor> grads) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!released_, "gradient context ", id_, " was released; create a new one");
    owners_.insert(owner);
  }
  return pr::send(agent_, owner, pr::GradPush{id_, ids, std::move(grads)});
}

absl::Status GradientContext::send(const std::vector<RemoteRef>& refs,
                                   const std::vector<at::Tensor>& grads) {
  if (released()) {
    return absl::FailedPreconditionError(
        absl::StrCat("GradientContext::send: context ", id_,
                     " was released; create a new context for new gradients"));
  }
  if (refs.size() != grads.size()) {
    return absl::InvalidArgumentError(absl::StrCat("GradientContext::send: ", refs.size(),
                                                   " parameters but ", grads.size(), " gradients"));
  }
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<at::Tensor>>> by_owner;
  for (size_t i = 0; i < refs.size(); ++i) {
    if (!grads[i].defined()) continue;
    auto& [ids, tensors] = by_owner[refs[i].owner];
    ids.push_back(refs[i].id);
    tensors.push_back(grads[i].detach());
  }
  pr::FanOut<pr::GradPush> pushes(agent_);
  for (auto& [owner, item] : by_owner)
    pushes.add(send_async(owner, item.first, std::move(item.second)));
  return pushes.wait();
}

absl::Status GradientContext::release() {
  std::set<std::string> owners;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (released_) return absl::OkStatus();
    released_ = true;
    owners.swap(owners_);
  }
  {
    ContextTable& t = contexts();
    std::lock_guard<std::mutex> lock(t.mu);
    t.live.erase(id_);
    t.released.insert(id_);
    t.released_order.push_back(id_);
    if (t.released_order.size() > kMaxReleased) {
      t.released.erase(t.released_order.front());
      t.released_order.pop_front();
    }
  }
  pr::FanOut<pr::GradRelease> releases(agent_);
  for (const auto& owner : owners) releases.send(owner, pr::GradRelease{id_});
  return releases.wait();
}

}  // namespace dtrain::rpc
