#include "rpc/remote.h"

#include <atomic>
#include <deque>

#include <c10/core/GradMode.h>

#include "absl/strings/str_cat.h"
#include "optim/registry.h"
#include "rpc/functions.h"
#include "rpc/local_optimizers.h"

namespace dtrain::rpc {

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

Reply empty_reply() { return Reply{}; }

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

void write_options(Writer& w, const optim::OptionsDict& options) {
  std::vector<std::pair<std::string, c10::IValue>> items;
  for (const auto& kv : options) {
    if (!kv.value().isNone()) items.emplace_back(kv.key().toStringRef(), kv.value());
  }
  w.i64(static_cast<int64_t>(items.size()));
  for (const auto& [key, v] : items) {
    w.str(key);
    if (v.isDouble()) {
      w.f64(v.toDouble());
    } else if (v.isBool()) {
      w.boolean(v.toBool());
    } else if (v.isInt()) {
      w.i64(v.toInt());
    } else if (v.isString()) {
      w.str(v.toStringRef());
    } else if (v.isTuple() || v.isList() || v.isDoubleList()) {
      std::vector<double> xs;
      const auto elements = v.isTuple() ? v.toTupleRef().elements().vec() : v.toListRef().vec();
      for (const auto& e : elements) xs.push_back(e.toScalar().toDouble());
      w.f64_list(xs);
    } else {
      TORCH_CHECK(false, "optimizer option '", key, "' has a type (", v.tagKind(),
                  ") that cannot travel: use numbers, booleans, strings or pairs of numbers");
    }
  }
}

optim::OptionsDict read_options(Reader& r) {
  optim::OptionsDict d = optim::new_options_dict();
  const int64_t n = r.i64();
  if (n < 0 || n > 1024) throw CodecError(absl::StrCat("option count ", n, " out of range"));
  for (int64_t i = 0; i < n; ++i) {
    const std::string key = r.str();
    switch (r.peek_tag()) {
      case Reader::kF64: d.insert(key, r.f64()); break;
      case Reader::kBool: d.insert(key, r.boolean()); break;
      case Reader::kI64: d.insert(key, r.i64()); break;
      case Reader::kStr: d.insert(key, r.str()); break;
      case Reader::kF64List: {
        std::vector<c10::IValue> xs;
        for (double x : r.f64_list()) xs.emplace_back(x);
        d.insert(key, c10::ivalue::Tuple::create(std::move(xs)));
        break;
      }
      default: throw CodecError(absl::StrCat("option '", key, "' has an unsupported value tag"));
    }
  }
  return d;
}

ParameterOwner::ParameterOwner(std::shared_ptr<Handlers> handlers) : state_(std::make_shared<State>()) {
  TORCH_CHECK(handlers != nullptr, "ParameterOwner needs the Handlers the agent will serve");
  std::weak_ptr<State> weak = state_;
  auto locked = [weak](const char* name) {
    auto s = weak.lock();
    TORCH_CHECK(s != nullptr, name, ": this worker's ParameterOwner is gone");
    return s;
  };
  handlers->add("dtrain.param.create", [locked](Request& r) {
    auto s = locked("dtrain.param.create");
    r.body.expect_done();
    TORCH_CHECK(r.tensors.size() == 1, "dtrain.param.create takes one tensor, got ", r.tensors.size());
    Reply reply;
    reply.body.i64(s->add(r.tensors[0].detach().clone()));
    return reply;
  });
  handlers->add("dtrain.param.fetch", [locked](Request& r) {
    auto s = locked("dtrain.param.fetch");
    const int64_t id = r.body.i64();
    r.body.expect_done();
    Reply reply;
    // A snapshot: the caller must not see a step half-applied.
    std::lock_guard<std::mutex> step(s->step_mu);
    reply.tensors.push_back(s->param(id).detach().clone());
    return reply;
  });
  handlers->add("dtrain.grad.push", [locked](Request& r) {
    auto s = locked("dtrain.grad.push");
    const int64_t context = r.body.i64();
    const std::vector<int64_t> ids = r.body.i64_list();
    r.body.expect_done();
    TORCH_CHECK(ids.size() == r.tensors.size(), "dtrain.grad.push: ", ids.size(), " parameter ids but ",
                r.tensors.size(), " gradients");
    std::vector<at::Tensor> params;
    for (size_t i = 0; i < ids.size(); ++i) {
      params.push_back(s->param(ids[i]));
      TORCH_CHECK(r.tensors[i].sizes().equals(params[i].sizes()) && r.tensors[i].dtype() == params[i].dtype(),
                  "gradient for parameter ", ids[i], " has shape ", r.tensors[i].sizes(), " (",
                  r.tensors[i].dtype(), ") but the parameter is ", params[i].sizes(), " (", params[i].dtype(), ")");
    }
    std::lock_guard<std::mutex> lock(s->mu);
    check_not_released(*s, context, "dtrain.grad.push");
    ++s->gradient_messages;
    auto& grads = s->contexts[context];
    for (size_t i = 0; i < ids.size(); ++i) {
      auto it = grads.find(ids[i]);
      if (it == grads.end()) {
        grads[ids[i]] = r.tensors[i].detach().clone();
      } else {
        it->second.add_(r.tensors[i]);
      }
    }
    return empty_reply();
  });
  handlers->add("dtrain.grad.release", [locked](Request& r) {
    auto s = locked("dtrain.grad.release");
    const int64_t context = r.body.i64();
    r.body.expect_done();
    std::lock_guard<std::mutex> lock(s->mu);
    s->contexts.erase(context);
    if (s->released.insert(context).second) {
      s->released_order.push_back(context);
      if (s->released_order.size() > kMaxReleased) {
        s->released.erase(s->released_order.front());
        s->released_order.pop_front();
      }
    }
    return empty_reply();
  });
  handlers->add("dtrain.fn.remote", [locked](Request& r) {
    auto s = locked("dtrain.fn.remote");
    const std::string fn = r.body.str();
    std::vector<c10::IValue> args = read_args(r.body, r.tensors);
    r.body.expect_done();
    at::Tensor value;
    {
      c10::NoGradGuard no_grad;  // the value is kept, not a node of some graph
      value = FunctionRegistry::global().call(fn, args).detach();
    }
    Reply reply;
    reply.body.i64(s->add(std::move(value)));
    return reply;
  });
  handlers->add("dtrain.optim.create", [locked](Request& r) {
    auto s = locked("dtrain.optim.create");
    const std::string key = r.body.str();
    const std::string name = r.body.str();
    optim::OptionsDict options = read_options(r.body);
    const std::vector<int64_t> ids = r.body.i64_list();
    r.body.expect_done();
    auto local = std::make_shared<State::LocalOptimizer>();
    std::vector<at::Tensor> params;
    for (int64_t id : ids) params.push_back(s->param(id));
    if (!optim::FunctionalRegistry::global().contains(name) && LocalOptimizerRegistry::global().contains(name)) {
      local->torch_optimizer = LocalOptimizerRegistry::global().create(name, params, options);
    } else {
      local->optimizer = optim::FunctionalRegistry::global().create(name, params, options);
    }
    local->params = std::move(params);
    local->ids = ids;
    std::lock_guard<std::mutex> lock(s->mu);
    TORCH_CHECK(s->optimizers.count(key) == 0, "an optimizer named ", key, " already exists here");
    s->optimizers[key] = std::move(local);
    return empty_reply();
  });
  handlers->add("dtrain.optim.step", [locked](Request& r) {
    auto s = locked("dtrain.optim.step");
    const std::string key = r.body.str();
    const int64_t context = r.body.i64();
    r.body.expect_done();
    std::lock_guard<std::mutex> step(s->step_mu);
    std::shared_ptr<State::LocalOptimizer> local;
    std::vector<at::Tensor> grads;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      auto it = s->optimizers.find(key);
      TORCH_CHECK(it != s->optimizers.end(), "no optimizer named ", key, " here (created? destroyed?)");
      local = it->second;
      check_not_released(*s, context, "DistributedOptimizer::step");
      auto ctx = s->contexts.find(context);
      // Unknown here: no gradient came under this context, nothing to do; the caller decides
      // whether that is an error (reply false).
      if (ctx == s->contexts.end()) return Reply{Writer().boolean(false), {}};
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
    return Reply{Writer().boolean(true), {}};
  });
  handlers->add("dtrain.optim.destroy", [locked](Request& r) {
    auto s = locked("dtrain.optim.destroy");
    const std::string key = r.body.str();
    r.body.expect_done();
    std::lock_guard<std::mutex> step(s->step_mu);
    std::lock_guard<std::mutex> lock(s->mu);
    s->optimizers.erase(key);
    return empty_reply();
  });
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

absl::StatusOr<RemoteRef> remote_parameter(Agent& agent, const std::string& owner, const at::Tensor& value) {
  absl::StatusOr<Response> r = agent.rpc_sync(owner, "dtrain.param.create", Writer(), {value.detach()});
  if (!r.ok()) return r.status();
  try {
    const int64_t id = r->body.i64();
    return RemoteRef{owner, id};
  } catch (const CodecError& e) {
    return absl::DataLossError(absl::StrCat("dtrain.param.create reply from '", owner, "': ", e.what()));
  }
}

absl::StatusOr<at::Tensor> to_here(Agent& agent, const RemoteRef& ref) {
  absl::StatusOr<Response> r = agent.rpc_sync(ref.owner, "dtrain.param.fetch", Writer().i64(ref.id));
  if (!r.ok()) return r.status();
  if (r->tensors.size() != 1) {
    return absl::DataLossError(absl::StrCat("dtrain.param.fetch from '", ref.owner, "' returned ", r->tensors.size(),
                                            " tensors"));
  }
  return r->tensors[0];
}

absl::StatusOr<RemoteRef> remote(Agent& agent, const std::string& worker, const std::string& fn,
                                 const std::vector<c10::IValue>& args) {
  Writer w;
  std::vector<at::Tensor> tensors;
  try {
    w.str(fn);
    write_args(w, tensors, args);
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(absl::StrCat("remote(", worker, ", ", fn, "): ", e.what_without_backtrace()));
  }
  absl::StatusOr<Response> r = agent.rpc_sync(worker, "dtrain.fn.remote", w, std::move(tensors));
  if (!r.ok()) return r.status();
  try {
    const int64_t id = r->body.i64();
    r->body.expect_done();
    return RemoteRef{worker, id};
  } catch (const CodecError& e) {
    return absl::DataLossError(absl::StrCat("dtrain.fn.remote reply from '", worker, "': ", e.what()));
  }
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
  return agent_.rpc_async(owner, "dtrain.grad.push", Writer().i64(id_).i64_list(ids), std::move(grads));
}

absl::Status GradientContext::send(const std::vector<RemoteRef>& refs, const std::vector<at::Tensor>& grads) {
  if (released()) {
    return absl::FailedPreconditionError(absl::StrCat("GradientContext::send: context ", id_,
                                                      " was released; create a new context for new gradients"));
  }
  if (refs.size() != grads.size()) {
    return absl::InvalidArgumentError(absl::StrCat("GradientContext::send: ", refs.size(), " parameters but ",
                                                   grads.size(), " gradients"));
  }
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<at::Tensor>>> by_owner;
  for (size_t i = 0; i < refs.size(); ++i) {
    if (!grads[i].defined()) continue;
    auto& [ids, tensors] = by_owner[refs[i].owner];
    ids.push_back(refs[i].id);
    tensors.push_back(grads[i].detach());
  }
  std::vector<CallFuture> calls;
  for (auto& [owner, item] : by_owner) calls.push_back(send_async(owner, item.first, std::move(item.second)));
  absl::Status first;
  for (auto& c : calls) {
    absl::StatusOr<Response> r = c.get();
    if (!r.ok() && first.ok()) first = r.status();
  }
  return first;
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
  std::vector<CallFuture> calls;
  for (const auto& owner : owners) calls.push_back(agent_.rpc_async(owner, "dtrain.grad.release", Writer().i64(id_)));
  absl::Status first;
  for (auto& c : calls) {
    absl::StatusOr<Response> r = c.get();
    if (!r.ok() && first.ok()) first = r.status();
  }
  return first;
}

}  // namespace dtrain::rpc
