#include "optim/hostile_state_dicts.h"

#include <cmath>
#include <functional>
#include <limits>
#include <set>

#include <ATen/ATen.h>

namespace dtrain::optim::testing {
namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

c10::impl::GenericDict dict(const c10::IValue& sd, const char* key) {
  return sd.toGenericDict().at(key).toGenericDict();
}
c10::impl::GenericDict group0(const c10::IValue& sd) {
  return sd.toGenericDict().at("param_groups").toList().get(0).toGenericDict();
}
c10::impl::GenericDict entry(const c10::IValue& sd, int64_t i) {
  return dict(sd, "state").at(i).toGenericDict();
}
std::string quoted(const std::string& key) { return "'" + key + "'"; }

class Builder {
 public:
  Builder(const c10::IValue& base, std::string optimizer)
      : base_(base), optimizer_(std::move(optimizer)) {}

  // A variant: `edit` applied to a deep copy of the base.
  void add(std::string label, std::string kind, const std::function<void(c10::IValue&)>& edit,
           bool refused, std::vector<std::string> names, bool may_go_non_finite = false) {
    Hostile h;
    h.label = optimizer_ + ": " + std::move(label);
    h.kind = std::move(kind);
    h.state_dict = base_.deepcopy();
    edit(h.state_dict);
    h.refused = refused;
    h.names = std::move(names);
    h.may_go_non_finite = may_go_non_finite;
    out_.push_back(std::move(h));
  }
  Hostile& last() { return out_.back(); }
  std::vector<Hostile> take() { return std::move(out_); }

 private:
  c10::IValue base_;
  std::string optimizer_;
  std::vector<Hostile> out_;
};

void set_value(c10::IValue& sd, int64_t i, const std::string& key, c10::IValue v) {
  entry(sd, i).insert_or_assign(key, std::move(v));
}

// The "step" variants of parameter i's entry: every one refused.
void step_variants(Builder& b, int64_t i) {
  const std::vector<std::string> names = {"'step'", "parameter " + std::to_string(i)};
  const std::string at = "state[" + std::to_string(i) + "]['step'] ";
  const std::vector<std::pair<std::string, c10::IValue>> values = {
      {"nan", at::scalar_tensor(kNan, at::kFloat)},
      {"inf", at::scalar_tensor(kInf, at::kFloat)},
      {"-inf", c10::IValue(-kInf)},
      {"negative", at::scalar_tensor(-50.0, at::kFloat)},
      {"negative", c10::IValue(int64_t{-50})},
      {"huge", c10::IValue(1e300)},
      {"huge", at::scalar_tensor(1e300, at::kDouble)},
      {"fraction", c10::IValue(2.5)},
      {"string", c10::IValue(std::string("5"))},
      {"2-element", at::ones({2})},
      {"empty tensor", at::ones({0})},
      {"wrong dtype", at::ones({}, at::kBool)},
      {"wrong dtype", at::ones({}, at::kComplexFloat)},
      {"None", c10::IValue()},
  };
  for (const auto& [kind, v] : values) {
    b.add(
        at + kind + " (" + v.tagKind() + ")", kind,
        [&](c10::IValue& sd) { set_value(sd, i, "step", v); }, true, names);
  }
  b.add(
      at + "missing", "missing", [&](c10::IValue& sd) { (void)entry(sd, i).erase("step"); }, true,
      names);
}

// The variants of a state tensor `key` of parameter i (value t).
void tensor_variants(Builder& b, int64_t i, const std::string& key, const at::Tensor& t,
                     bool optional) {
  const std::vector<std::string> names = {quoted(key), "parameter " + std::to_string(i)};
  const std::string at = "state[" + std::to_string(i) + "][" + quoted(key) + "] ";
  auto set = [&](const std::string& kind, const at::Tensor& v, bool refused,
                 bool may_go_non_finite = false) {
    b.add(
        at + kind, kind, [&](c10::IValue& sd) { set_value(sd, i, key, v); }, refused, names,
        may_go_non_finite);
  };
  set("wrong size", at::zeros({t.numel() + 1}), true);
  set("wrong size", t.dim() == 0 ? at::zeros({2}) : at::zeros({}), true);
  set("wrong dtype", t.to(at::kLong), true);
  set("wrong dtype", t.to(at::kBool), true);
  set("wrong dtype", t.to(at::kComplexFloat), true);
  set("float64 (PyTorch casts it)", t.to(at::kDouble), false);
  set("float64 inf once cast", at::full_like(t, 1e300, at::kDouble), true);
  at::Tensor nan = t.clone();
  nan.view(-1)[nan.numel() - 1] = kNan;
  set("nan", nan, true);
  at::Tensor inf = t.clone();
  inf.view(-1)[0] = kInf;
  set("inf", inf, true);
  set("-inf", at::full_like(t, -kInf), true);
  // Negative state: PyTorch loads it (a negative second moment then gives NaN under the square
  // root, in PyTorch as here).
  set("negative (PyTorch accepts it)", -(t.abs() + 1), false, /*may_go_non_finite=*/true);
  set("sparse", t.dim() == 0 ? at::zeros({2}).to_sparse() : t.to_sparse(), true);
  b.add(
      at + "string", "string", [&](c10::IValue& sd) { set_value(sd, i, key, std::string("x")); },
      true, names);
  b.add(
      at + "int", "string", [&](c10::IValue& sd) { set_value(sd, i, key, int64_t{3}); }, true,
      names);
  b.add(
      at + "None", "None", [&](c10::IValue& sd) { set_value(sd, i, key, c10::IValue()); },
      !optional, names);
  b.add(
      at + "missing", "missing", [&](c10::IValue& sd) { (void)entry(sd, i).erase(key); }, !optional,
      names);
}

void set_params(c10::IValue& sd, std::vector<int64_t> params) {
  group0(sd).insert_or_assign("params", c10::List<int64_t>(std::move(params)));
}

void index_variants(Builder& b, size_t n) {
  std::vector<int64_t> all;
  for (size_t i = 0; i < n; ++i) all.push_back(static_cast<int64_t>(i));
  auto with = [&](size_t at, int64_t v) {
    std::vector<int64_t> p = all;
    p[at] = v;
    return p;
  };
  const auto last = static_cast<int64_t>(n - 1);
  b.add("params [-1, 1, ...]", "param index", [&](c10::IValue& sd) { set_params(sd, with(0, -1)); },
        true, {"'params'", "-1"});
  b.add("params out of range", "param index",
        [&](c10::IValue& sd) { set_params(sd, with(n - 1, last + 5)); }, true,
        {"'params'", std::to_string(last + 5)});
  b.add("params duplicated", "param index", [&](c10::IValue& sd) { set_params(sd, with(0, 1)); },
        true, {"parameter 1", "twice"});
  b.add("params one short", "param index",
        [&](c10::IValue& sd) { set_params(sd, std::vector<int64_t>(all.begin(), all.end() - 1)); },
        true, {"parameter"});
  b.add("params hold a string", "param index",
        [&](c10::IValue& sd) {
          c10::impl::GenericList l(c10::AnyType::get());
          l.push_back(std::string("0"));
          for (size_t i = 1; i < n; ++i) l.push_back(static_cast<int64_t>(i));
          group0(sd).insert_or_assign("params", l);
        },
        true, {"'params'"});
  b.add("params missing", "param index", [&](c10::IValue& sd) { (void)group0(sd).erase("params"); },
        true, {"'params'"});
  b.add("state for parameter 99", "param index",
        [&](c10::IValue& sd) { dict(sd, "state").insert(int64_t{99}, entry(sd, last)); }, true,
        {"parameter", "99"});
}

void option_variants(Builder& b, const c10::IValue& base) {
  const c10::impl::GenericDict g = group0(base);
  auto set = [&](const std::string& key, const std::string& kind, c10::IValue v) {
    b.add("param_groups[0][" + quoted(key) + "] " + kind, "option " + kind,
          [&](c10::IValue& sd) { group0(sd).insert_or_assign(key, v); }, true,
          {"param_groups[0]", quoted(key)});
  };
  set("lr", "nan", kNan);
  set("lr", "inf", kInf);
  set("lr", "negative", -1.0);
  set("lr", "string", std::string("0.01"));
  for (const char* key : {"weight_decay", "momentum", "eps"}) {
    if (!g.contains(key) || !g.at(key).isDouble()) continue;
    set(key, "nan", kNan);
    set(key, "inf", kInf);
  }
  if (g.contains("betas")) {
    set("betas", "nan", c10::ivalue::Tuple::create({kNan, 0.999}));
    set("betas", "string", std::string("(0.9, 0.999)"));
  }
}

// Each option dropped from the group: accepted with PyTorch's value where PyTorch's load fills it
// in, refused naming it where PyTorch's next step would fail (`oracle`: make_campaign_states.py's).
void missing_option_variants(Builder& b, const c10::IValue& oracle) {
  if (!oracle.isGenericDict()) return;
  for (const auto& kv : oracle.toGenericDict()) {
    const std::string key = kv.key().toStringRef();
    const c10::impl::GenericDict verdict = kv.value().toGenericDict();
    const bool accepted = verdict.at("accepted").toBool();
    b.add("param_groups[0][" + quoted(key) + "] missing", "option missing",
          [&](c10::IValue& sd) { (void)group0(sd).erase(key); }, !accepted,
          {"param_groups[0]", quoted(key)});
    if (accepted) {
      b.last().option_key = key;
      b.last().option_after = verdict.at("value");
    }
  }
}

}  // namespace

std::vector<Hostile> hostile_variants(const c10::IValue& state_dict,
                                      const std::vector<at::Tensor>& params,
                                      const std::string& optimizer,
                                      const c10::IValue& missing_options) {
  Builder b(state_dict, optimizer);
  // Each key once, at a parameter that has it, going round the parameters.
  std::set<std::string> done;
  const c10::impl::GenericDict state = dict(state_dict, "state");
  std::vector<int64_t> with_state;
  for (const auto& kv : state) with_state.push_back(kv.key().toInt());
  for (size_t round = 0; round < with_state.size(); ++round) {
    const int64_t i = with_state[(round + 1) % with_state.size()];
    for (const auto& kv : entry(state_dict, i)) {
      const std::string key = kv.key().toStringRef();
      if (!done.insert(key).second) continue;
      if (key == "step") {
        step_variants(b, i);
      } else if (kv.value().isTensor()) {
        tensor_variants(b, i, key, kv.value().toTensor(),
                        /*optional=*/optimizer == "SGD" && key == "momentum_buffer");
      }
    }
  }
  if (done.count("step") == 0) {  // an optimizer without step counts (SGD, Muon)
    const int64_t i = with_state.front();
    b.add("state[" + std::to_string(i) + "]['step'] added", "step added",
          [&](c10::IValue& sd) { set_value(sd, i, "step", at::scalar_tensor(2.0)); }, true,
          {"'step'", "parameter " + std::to_string(i)});
  }
  index_variants(b, params.size());
  option_variants(b, state_dict);
  missing_option_variants(b, missing_options);
  return b.take();
}

}  // namespace dtrain::optim::testing
