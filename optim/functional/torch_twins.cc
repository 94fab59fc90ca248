#include "optim/functional/torch_twins.h"

#include <cmath>
#include <type_traits>
#include <utility>

#include <ATen/ATen.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "optim/functional/libtorch_compat.h"

namespace dtrain::optim {
namespace {

using Entry = c10::impl::GenericDict;

Entry new_entry() { return Entry(c10::StringType::get(), c10::AnyType::get()); }

// --- Options: PyTorch's names, LibTorch's fields. ---

double num(const OptionsDict& d, const char* k, double fallback) {
  if (!d.contains(k)) return fallback;
  const c10::IValue& v = d.at(k);
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}
bool flag(const OptionsDict& d, const char* k, bool fallback) {
  return d.contains(k) ? d.at(k).toBool() : fallback;
}
std::tuple<double, double> betas(const OptionsDict& d, std::tuple<double, double> fallback) {
  if (!d.contains("betas")) return fallback;
  auto e = d.at("betas").toTupleRef().elements();
  return {e[0].toDouble(), e[1].toDouble()};
}
c10::IValue betas_value(const std::tuple<double, double>& b) {
  return c10::ivalue::Tuple::create({std::get<0>(b), std::get<1>(b)});
}

// PyTorch's keys that LibTorch's optimizers have no field for, with the value that says what a
// LibTorch optimizer does: it never maximizes, has no CUDA-graph (capturable) or autograd-through-
// step (differentiable) mode, and its implementation is neither chosen by foreach nor fused (None,
// PyTorch's default: "pick for me").
void torch_only(OptionsDict& d, const char* key) {
  const std::string k = key;
  d.insert(k, k == "foreach" || k == "fused" ? c10::IValue() : c10::IValue(false));
}

// Loading a param group into a LibTorch optimizer: a PyTorch key that changes the math and that
// LibTorch has no field for (maximize, decoupled_weight_decay) must hold the value LibTorch's
// math has (`want`), else the state dict describes an optimizer LibTorch cannot continue. A
// missing key or None passes. (foreach, fused, capturable and differentiable pick an
// implementation or a CUDA-graph / autograd mode, not the numbers: any value is taken.)
void require_torch_only(const OptionsDict& d, const char* optimizer, const char* key, bool want) {
  if (!d.contains(key) || d.at(key).isNone()) return;
  const c10::IValue& v = d.at(key);
  TORCH_CHECK(v.isBool() && v.toBool() == want, "load_torch_optim_state_dict: the param group has ",
              key, "=", v.isBool() ? (v.toBool() ? "True" : "False") : v.tagKind(),
              ", which torch::optim::", optimizer, " cannot run (it has ", key, "=",
              want ? "True" : "False", " only); load the state dict into the functional ",
              optimizer, " (FunctionalRegistry's \"", optimizer, "\") instead");
}

OptionsDict sgd_options(const torch::optim::SGDOptions& o) {
  OptionsDict d = new_options_dict();
  d.insert("lr", o.lr());
  d.insert("momentum", o.momentum());
  d.insert("dampening", o.dampening());
  d.insert("weight_decay", o.weight_decay());
  d.insert("nesterov", o.nesterov());
  for (const char* k : {"maximize", "foreach", "differentiable", "fused"}) torch_only(d, k);
  return d;
}
void apply_sgd(torch::optim::SGDOptions& s, const OptionsDict& d) {
  require_torch_only(d, "SGD", "maximize", false);
  s.lr(num(d, "lr", s.lr()))
      .momentum(num(d, "momentum", s.momentum()))
      .dampening(num(d, "dampening", s.dampening()));
  s.weight_decay(num(d, "weight_decay", s.weight_decay()))
      .nesterov(flag(d, "nesterov", s.nesterov()));
}

// AdamW's options (else Adam's): its weight decay is decoupled.
template <typename AdamLikeOptions>
constexpr bool kIsAdamW = std::is_same_v<AdamLikeOptions, torch::optim::AdamWOptions>;

template <typename AdamLikeOptions>  // AdamOptions, AdamWOptions
OptionsDict adam_options(const AdamLikeOptions& o) {
  OptionsDict d = new_options_dict();
  d.insert("lr", o.lr());
  d.insert("betas", betas_value(o.betas()));
  d.insert("eps", o.eps());
  d.insert("weight_decay", o.weight_decay());
  d.insert("amsgrad", o.amsgrad());
  for (const char* k : {"maximize", "foreach", "capturable", "differentiable", "fused"}) {
    torch_only(d, k);
  }
  // PyTorch 2.7+: AdamW is Adam with decoupled_weight_decay=True, and both groups say which.
  if constexpr (kAdamHasDecoupledWeightDecay) {
    d.insert("decoupled_weight_decay", kIsAdamW<AdamLikeOptions>);
  }
  return d;
}
template <typename AdamLikeOptions>
void apply_adam(AdamLikeOptions& a, const OptionsDict& d) {
  const char* name = kIsAdamW<AdamLikeOptions> ? "AdamW" : "Adam";
  require_torch_only(d, name, "maximize", false);
  require_torch_only(d, name, "decoupled_weight_decay", kIsAdamW<AdamLikeOptions>);
  a.lr(num(d, "lr", a.lr())).betas(betas(d, a.betas())).eps(num(d, "eps", a.eps()));
  a.weight_decay(num(d, "weight_decay", a.weight_decay())).amsgrad(flag(d, "amsgrad", a.amsgrad()));
}

OptionsDict adagrad_options(const torch::optim::AdagradOptions& o) {
  OptionsDict d = new_options_dict();
  d.insert("lr", o.lr());
  d.insert("lr_decay", o.lr_decay());
  d.insert("eps", o.eps());
  d.insert("weight_decay", o.weight_decay());
  d.insert("initial_accumulator_value", o.initial_accumulator_value());
  for (const char* k : {"foreach", "maximize", "differentiable", "fused"}) torch_only(d, k);
  return d;
}
void apply_adagrad(torch::optim::AdagradOptions& g, const OptionsDict& d) {
  require_torch_only(d, "Adagrad", "maximize", false);
  g.lr(num(d, "lr", g.lr())).lr_decay(num(d, "lr_decay", g.lr_decay())).eps(num(d, "eps", g.eps()));
  g.weight_decay(num(d, "weight_decay", g.weight_decay()));
  g.initial_accumulator_value(num(d, "initial_accumulator_value", g.initial_accumulator_value()));
}

OptionsDict rmsprop_options(const torch::optim::RMSpropOptions& o) {
  OptionsDict d = new_options_dict();
  d.insert("lr", o.lr());
  d.insert("momentum", o.momentum());
  d.insert("alpha", o.alpha());
  d.insert("eps", o.eps());
  d.insert("centered", o.centered());
  d.insert("weight_decay", o.weight_decay());
  for (const char* k : {"capturable", "foreach", "maximize", "differentiable"}) torch_only(d, k);
  return d;
}
void apply_rmsprop(torch::optim::RMSpropOptions& r, const OptionsDict& d) {
  require_torch_only(d, "RMSprop", "maximize", false);
  r.lr(num(d, "lr", r.lr())).alpha(num(d, "alpha", r.alpha())).eps(num(d, "eps", r.eps()));
  r.weight_decay(num(d, "weight_decay", r.weight_decay()))
      .momentum(num(d, "momentum", r.momentum()));
  r.centered(flag(d, "centered", r.centered()));
}

// --- Parameter state: PyTorch's entry, LibTorch's state object. ---

void put(Entry& e, const char* name, const at::Tensor& t) {
  if (t.defined()) e.insert(name, t);
}
c10::IValue float_step(int64_t step) {
  return at::scalar_tensor(static_cast<double>(step), at::kFloat);
}

at::Tensor tensor_or_undefined(const Entry& e, const char* name, const at::Tensor& like,
                               int64_t index) {
  if (!e.contains(name) || e.at(name).isNone()) return at::Tensor();
  const at::Tensor& t = e.at(name).toTensor();
  TORCH_CHECK(t.sizes() == like.sizes(), "load_torch_optim_state_dict: state '", name,
              "' of parameter ", index, " has shape ", t.sizes(), ", the parameter has shape ",
              like.sizes());
  return at::empty_like(like).copy_(t);
}

// "step" as PyTorch writes it (a one-element tensor, an int or a float): a whole number from 0 to
// 2^53 (beyond, a float32 or double step is no longer exact), else an error naming the parameter.
int64_t step_of(const Entry& e, int64_t index) {
  if (!e.contains("step")) return 0;
  const c10::IValue& v = e.at("step");
  const bool number = v.isInt() || v.isDouble() || (v.isTensor() && v.toTensor().numel() == 1);
  TORCH_CHECK(number, "load_torch_optim_state_dict: state 'step' of parameter ", index,
              " is not a number (", v.isTensor() ? "a tensor of shape " : v.tagKind(),
              v.isTensor() ? c10::str(v.toTensor().sizes()) : "",
              "); load a state dict that PyTorch or dtrain wrote");
  if (v.isInt()) {
    TORCH_CHECK(v.toInt() >= 0, "load_torch_optim_state_dict: state 'step' of parameter ", index,
                " is ", v.toInt(), "; a step count is >= 0");
    return v.toInt();
  }
  const double d = v.isDouble() ? v.toDouble() : v.toTensor().item<double>();
  TORCH_CHECK(std::isfinite(d) && d >= 0 && d <= 9007199254740992.0 && std::nearbyint(d) == d,
              "load_torch_optim_state_dict: state 'step' of parameter ", index, " is ", d,
              "; a step count is a whole number from 0 to 2^53");
  return static_cast<int64_t>(d);
}

Entry sgd_entry(const torch::optim::SGDParamState& s) {
  Entry e = new_entry();
  e.insert("momentum_buffer",
           s.momentum_buffer().defined() ? c10::IValue(s.momentum_buffer()) : c10::IValue());
  return e;
}
std::unique_ptr<torch::optim::SGDParamState> sgd_state(const Entry& e, const at::Tensor& p,
                                                       int64_t index) {
  auto x = std::make_unique<torch::optim::SGDParamState>();
  x->momentum_buffer(tensor_or_undefined(e, "momentum_buffer", p, index));
  return x;
}

template <typename AdamLikeState>  // AdamParamState, AdamWParamState
Entry adam_entry(const AdamLikeState& s) {
  Entry e = new_entry();
  e.insert("step", float_step(s.step()));
  put(e, "exp_avg", s.exp_avg());
  put(e, "exp_avg_sq", s.exp_avg_sq());
  put(e, "max_exp_avg_sq", s.max_exp_avg_sq());
  return e;
}
template <typename AdamLikeState>
std::unique_ptr<AdamLikeState> adam_state(const Entry& e, const at::Tensor& p, int64_t index) {
  auto x = std::make_unique<AdamLikeState>();
  x->step(step_of(e, index));
  x->exp_avg(tensor_or_undefined(e, "exp_avg", p, index));
  x->exp_avg_sq(tensor_or_undefined(e, "exp_avg_sq", p, index));
  x->max_exp_avg_sq(tensor_or_undefined(e, "max_exp_avg_sq", p, index));
  return x;
}

Entry adagrad_entry(const torch::optim::AdagradParamState& s) {
  Entry e = new_entry();
  e.insert("step", float_step(s.step()));
  put(e, "sum", s.sum());
  return e;
}
std::unique_ptr<torch::optim::AdagradParamState> adagrad_state(const Entry& e, const at::Tensor& p,
                                                               int64_t index) {
  auto x = std::make_unique<torch::optim::AdagradParamState>();
  x->step(step_of(e, index));
  x->sum(tensor_or_undefined(e, "sum", p, index));
  return x;
}

Entry rmsprop_entry(const torch::optim::RMSpropParamState& s) {
  Entry e = new_entry();
  e.insert("step",
           float_step(s.step()));  // PyTorch 2.x's RMSprop keeps a float32 tensor, as Adam does
  put(e, "square_avg", s.square_avg());
  put(e, "momentum_buffer", s.momentum_buffer());
  put(e, "grad_avg", s.grad_avg());
  return e;
}
std::unique_ptr<torch::optim::RMSpropParamState> rmsprop_state(const Entry& e, const at::Tensor& p,
                                                               int64_t index) {
  auto x = std::make_unique<torch::optim::RMSpropParamState>();
  x->step(step_of(e, index));
  x->square_avg(tensor_or_undefined(e, "square_avg", p, index));
  x->momentum_buffer(tensor_or_undefined(e, "momentum_buffer", p, index));
  x->grad_avg(tensor_or_undefined(e, "grad_avg", p, index));
  return x;
}

// LibTorch's default options of each type (SGDOptions has no default lr; PyTorch's is 1e-3).
template <typename Options>
Options default_options() {
  if constexpr (std::is_same_v<Options, torch::optim::SGDOptions>) {
    return Options(1e-3);
  } else {
    return Options();
  }
}

// One row: the typed functions above behind the type tests (the only dynamic_casts on these types).
template <typename Optimizer, typename Options, typename State>
TorchTwin twin(const char* name, OptionsDict (*to_dict)(const Options&),
               void (*apply)(Options&, const OptionsDict&), Entry (*to_entry)(const State&),
               std::unique_ptr<State> (*from_entry)(const Entry&, const at::Tensor&, int64_t)) {
  return TorchTwin{
      name,
      std::type_index(typeid(Optimizer)),
      [](const torch::optim::OptimizerOptions& o) {
        return dynamic_cast<const Options*>(&o) != nullptr;
      },
      [](const torch::optim::OptimizerParamState& s) {
        return dynamic_cast<const State*>(&s) != nullptr;
      },
      [to_dict](const torch::optim::OptimizerOptions& o) {
        return to_dict(dynamic_cast<const Options&>(o));
      },
      [apply](torch::optim::OptimizerOptions& o, const OptionsDict& d) {
        apply(dynamic_cast<Options&>(o), d);
      },
      [to_entry](const torch::optim::OptimizerParamState& s) {
        return to_entry(dynamic_cast<const State&>(s));
      },
      [from_entry](const Entry& e, const at::Tensor& p, int64_t index) {
        return std::unique_ptr<torch::optim::OptimizerParamState>(from_entry(e, p, index));
      },
      [apply](std::vector<at::Tensor> params, const OptionsDict& d) {
        Options o = default_options<Options>();
        apply(o, d);
        return std::unique_ptr<torch::optim::Optimizer>(
            std::make_unique<Optimizer>(std::move(params), o));
      },
  };
}

}  // namespace

const std::vector<TorchTwin>& torch_twins() {
  namespace o = torch::optim;
  static const std::vector<TorchTwin>* table = new std::vector<TorchTwin>{
      twin<o::SGD, o::SGDOptions, o::SGDParamState>("SGD", sgd_options, apply_sgd, sgd_entry,
                                                    sgd_state),
      twin<o::Adam, o::AdamOptions, o::AdamParamState>(
          "Adam", adam_options<o::AdamOptions>, apply_adam<o::AdamOptions>,
          adam_entry<o::AdamParamState>, adam_state<o::AdamParamState>),
      twin<o::AdamW, o::AdamWOptions, o::AdamWParamState>(
          "AdamW", adam_options<o::AdamWOptions>, apply_adam<o::AdamWOptions>,
          adam_entry<o::AdamWParamState>, adam_state<o::AdamWParamState>),
      twin<o::Adagrad, o::AdagradOptions, o::AdagradParamState>(
          "Adagrad", adagrad_options, apply_adagrad, adagrad_entry, adagrad_state),
      twin<o::RMSprop, o::RMSpropOptions, o::RMSpropParamState>(
          "RMSprop", rmsprop_options, apply_rmsprop, rmsprop_entry, rmsprop_state),
  };
  return *table;
}

const TorchTwin* twin_named(const std::string& name) {
  for (const TorchTwin& t : torch_twins()) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

const TorchTwin* twin_of(const torch::optim::OptimizerOptions& options) {
  for (const TorchTwin& t : torch_twins()) {
    if (t.owns_options(options)) return &t;
  }
  return nullptr;
}

const TorchTwin* twin_of(const torch::optim::OptimizerParamState& state) {
  for (const TorchTwin& t : torch_twins()) {
    if (t.owns_state(state)) return &t;
  }
  return nullptr;
}

}  // namespace dtrain::optim
