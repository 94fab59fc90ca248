#include "optim/torch_state.h"

#include <ATen/ATen.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "optim/functional_optimizer.h"
#include "optim/libtorch_compat.h"
#include "optim/registry.h"

namespace dtrain::optim {
namespace {

using Entry = c10::impl::GenericDict;

Entry new_entry() { return Entry(c10::StringType::get(), c10::AnyType::get()); }

void put(Entry& e, const char* name, const at::Tensor& t) {
  if (t.defined()) e.insert(name, t);
}

at::Tensor tensor_or_undefined(const Entry& e, const char* name, const at::Tensor& like, size_t index) {
  if (!e.contains(name) || e.at(name).isNone()) return at::Tensor();
  const at::Tensor& t = e.at(name).toTensor();
  TORCH_CHECK(t.sizes() == like.sizes(), "load_torch_optim_state_dict: state '", name, "' of parameter ",
              index, " has shape ", t.sizes(), ", the parameter has shape ", like.sizes());
  return at::empty_like(like).copy_(t);
}

int64_t step_of(const Entry& e) {
  if (!e.contains("step")) return 0;
  const c10::IValue& v = e.at("step");
  return v.isTensor() ? static_cast<int64_t>(v.toTensor().item<double>()) : v.toInt();
}

double num(const OptionsDict& d, const char* k, double fallback) {
  if (!d.contains(k)) return fallback;
  const c10::IValue& v = d.at(k);
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}
bool flag(const OptionsDict& d, const char* k, bool fallback) { return d.contains(k) ? d.at(k).toBool() : fallback; }
std::tuple<double, double> betas(const OptionsDict& d, std::tuple<double, double> fallback) {
  if (!d.contains("betas")) return fallback;
  auto e = d.at("betas").toTupleRef().elements();
  return {e[0].toDouble(), e[1].toDouble()};
}

void apply_group_options(torch::optim::OptimizerOptions& o, const OptionsDict& d) {
  if (auto* s = dynamic_cast<torch::optim::SGDOptions*>(&o)) {
    s->lr(num(d, "lr", s->lr())).momentum(num(d, "momentum", s->momentum())).dampening(num(d, "dampening", s->dampening()));
    s->weight_decay(num(d, "weight_decay", s->weight_decay())).nesterov(flag(d, "nesterov", s->nesterov()));
  } else if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&o)) {
    a->lr(num(d, "lr", a->lr())).betas(betas(d, a->betas())).eps(num(d, "eps", a->eps()));
    a->weight_decay(num(d, "weight_decay", a->weight_decay())).amsgrad(flag(d, "amsgrad", a->amsgrad()));
  } else if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&o)) {
    w->lr(num(d, "lr", w->lr())).betas(betas(d, w->betas())).eps(num(d, "eps", w->eps()));
    w->weight_decay(num(d, "weight_decay", w->weight_decay())).amsgrad(flag(d, "amsgrad", w->amsgrad()));
  } else if (auto* g = dynamic_cast<torch::optim::AdagradOptions*>(&o)) {
    g->lr(num(d, "lr", g->lr())).lr_decay(num(d, "lr_decay", g->lr_decay())).eps(num(d, "eps", g->eps()));
    g->weight_decay(num(d, "weight_decay", g->weight_decay()));
    g->initial_accumulator_value(num(d, "initial_accumulator_value", g->initial_accumulator_value()));
  } else if (auto* r = dynamic_cast<torch::optim::RMSpropOptions*>(&o)) {
    r->lr(num(d, "lr", r->lr())).alpha(num(d, "alpha", r->alpha())).eps(num(d, "eps", r->eps()));
    r->weight_decay(num(d, "weight_decay", r->weight_decay())).momentum(num(d, "momentum", r->momentum()));
    r->centered(flag(d, "centered", r->centered()));
  }
}

}  // namespace

c10::IValue torch_optim_state_dict(const torch::optim::Optimizer& optimizer) {
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericList groups(c10::AnyType::get());
  int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    const torch::optim::OptimizerOptions& o = group.has_options() ? group.options() : optimizer.defaults();
    OptionsDict g = options_from_torch(o);  // TORCH_CHECKs the type
    std::vector<int64_t> indices;
    for (const auto& p : group.params()) {
      indices.push_back(index);
      auto it = optimizer.state().find(param_state_key(p));
      if (it != optimizer.state().end()) {
        Entry e = new_entry();
        const torch::optim::OptimizerParamState* s = it->second.get();
        if (auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
          e.insert("momentum_buffer", sgd->momentum_buffer().defined() ? c10::IValue(sgd->momentum_buffer()) : c10::IValue());
        } else if (auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
          e.insert("step", at::scalar_tensor(static_cast<double>(adam->step()), at::kFloat));
          put(e, "exp_avg", adam->exp_avg());
          put(e, "exp_avg_sq", adam->exp_avg_sq());
          put(e, "max_exp_avg_sq", adam->max_exp_avg_sq());
        } else if (auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
          e.insert("step", at::scalar_tensor(static_cast<double>(adamw->step()), at::kFloat));
          put(e, "exp_avg", adamw->exp_avg());
          put(e, "exp_avg_sq", adamw->exp_avg_sq());
          put(e, "max_exp_avg_sq", adamw->max_exp_avg_sq());
        } else if (auto* ada = dynamic_cast<const torch::optim::AdagradParamState*>(s)) {
          e.insert("step", at::scalar_tensor(static_cast<double>(ada->step()), at::kFloat));
          put(e, "sum", ada->sum());
        } else if (auto* rms = dynamic_cast<const torch::optim::RMSpropParamState*>(s)) {
          e.insert("step", rms->step());
          put(e, "square_avg", rms->square_avg());
          put(e, "momentum_buffer", rms->momentum_buffer());
          put(e, "grad_avg", rms->grad_avg());
        } else {
          TORCH_CHECK(false, "torch_optim_state_dict: unsupported parameter state type ", typeid(*s).name());
        }
        state.insert(index, e);
      }
      ++index;
    }
    g.insert("params", c10::List<int64_t>(indices));
    groups.push_back(g);
  }
  c10::impl::GenericDict sd(c10::StringType::get(), c10::AnyType::get());
  sd.insert("state", state);
  sd.insert("param_groups", groups);
  return sd;
}

void load_torch_optim_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state_dict) {
  auto sd = state_dict.toGenericDict();
  auto groups = sd.at("param_groups").toList();
  auto state = sd.at("state").toGenericDict();
  TORCH_CHECK(groups.size() == optimizer.param_groups().size(), "load_torch_optim_state_dict: the state dict has ",
              groups.size(), " parameter groups, the optimizer has ", optimizer.param_groups().size());
  const torch::optim::OptimizerOptions& defaults = optimizer.defaults();
  const bool is_sgd = dynamic_cast<const torch::optim::SGDOptions*>(&defaults) != nullptr;
  const bool is_adam = dynamic_cast<const torch::optim::AdamOptions*>(&defaults) != nullptr;
  const bool is_adamw = dynamic_cast<const torch::optim::AdamWOptions*>(&defaults) != nullptr;
  const bool is_adagrad = dynamic_cast<const torch::optim::AdagradOptions*>(&defaults) != nullptr;
  const bool is_rmsprop = dynamic_cast<const torch::optim::RMSpropOptions*>(&defaults) != nullptr;
  TORCH_CHECK(is_sgd || is_adam || is_adamw || is_adagrad || is_rmsprop,
              "load_torch_optim_state_dict: unsupported optimizer (SGD, Adam, AdamW, Adagrad, RMSprop are)");
  std::remove_reference_t<decltype(optimizer.state())> loaded;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    auto group = groups.get(gi).toGenericDict();
    auto& target = optimizer.param_groups()[gi];
    const auto indices = group.at("params").toList();
    TORCH_CHECK(indices.size() == target.params().size(), "load_torch_optim_state_dict: group ", gi, " has ",
                indices.size(), " parameters in the state dict and ", target.params().size(), " in the optimizer");
    if (target.has_options()) apply_group_options(target.options(), group);
    for (size_t i = 0; i < indices.size(); ++i) {
      const c10::IValue key(indices.get(i).toInt());
      if (!state.contains(key)) continue;
      const Entry e = state.at(key).toGenericDict();
      const at::Tensor& p = target.params()[i];
      const size_t index = static_cast<size_t>(key.toInt());
      std::unique_ptr<torch::optim::OptimizerParamState> s;
      if (is_sgd) {
        auto x = std::make_unique<torch::optim::SGDParamState>();
        x->momentum_buffer(tensor_or_undefined(e, "momentum_buffer", p, index));
        s = std::move(x);
      } else if (is_adam || is_adamw) {
        auto fill = [&](auto x) {
          x->step(step_of(e));
          x->exp_avg(tensor_or_undefined(e, "exp_avg", p, index));
          x->exp_avg_sq(tensor_or_undefined(e, "exp_avg_sq", p, index));
          x->max_exp_avg_sq(tensor_or_undefined(e, "max_exp_avg_sq", p, index));
          return x;
        };
        if (is_adam) {
          s = fill(std::make_unique<torch::optim::AdamParamState>());
        } else {
          s = fill(std::make_unique<torch::optim::AdamWParamState>());
        }
      } else if (is_adagrad) {
        auto x = std::make_unique<torch::optim::AdagradParamState>();
        x->step(step_of(e));
        x->sum(tensor_or_undefined(e, "sum", p, index));
        s = std::move(x);
      } else {
        auto x = std::make_unique<torch::optim::RMSpropParamState>();
        x->step(step_of(e));
        x->square_avg(tensor_or_undefined(e, "square_avg", p, index));
        x->momentum_buffer(tensor_or_undefined(e, "momentum_buffer", p, index));
        x->grad_avg(tensor_or_undefined(e, "grad_avg", p, index));
        s = std::move(x);
      }
      loaded[param_state_key(p)] = std::move(s);
    }
  }
  optimizer.state() = std::move(loaded);
}

int64_t state_tensor_bytes(const c10::IValue& state_dict) {
  int64_t bytes = 0;
  for (const auto& kv : state_dict.toGenericDict().at("state").toGenericDict()) {
    for (const auto& e : kv.value().toGenericDict()) {
      if (e.value().isTensor()) bytes += static_cast<int64_t>(e.value().toTensor().nbytes());
    }
  }
  return bytes;
}

}  // namespace dtrain::optim
