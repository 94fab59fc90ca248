// dtrain's optimizer state dicts against what the installed PyTorch writes for the same optimizer
// (testdata/make_state_keys.py, run at build time by the PyTorch beside the LibTorch being built:
// 2.14 in the Debian sid root, 2.6 in the Debian 13 one): the same param_group keys, the same
// state entries with the same kind ("step" a float32 0-dim tensor, a Python int or absent) and
// shape, for every built-in functional optimizer and for LibTorch's own SGD, Adam, AdamW, Adagrad
// and RMSprop through torch_optim_state_dict. One key dropped or added fails the test, naming it.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "optim/functional/builtin_optimizers.h"
#include "optim/functional/registry.h"
#include "optim/functional/torch_state.h"
#include "optim/functional/torch_twins.h"

namespace dtrain::optim {
namespace {

constexpr char kOracle[] = "optim/functional/installed_pytorch/state_keys.txt";

// One case of the oracle: how the optimizer was built and run, and what its state dict held.
struct KeysCase {
  std::string name;  // PyTorch's class name, the registry's name
  std::string options_line;
  OptionsDict options = new_options_dict();
  std::vector<std::vector<int64_t>> shapes;
  bool sparse_grads = false;
  int steps = 0;
  std::map<std::string, std::string> group;  // key -> value, as make_state_keys.py writes it
  std::set<std::string> state;               // "PARAM KEY KIND SHAPE"
};

struct Oracle {
  std::string torch_version;
  std::set<std::string> absent;  // optimizers this PyTorch lacks
  std::vector<KeysCase> cases;
};

c10::IValue parse_value(const std::string& text) {
  if (text == "True") return true;
  if (text == "False") return false;
  if (text == "none") return c10::IValue();
  double v = 0;
  if (text.find(',') != std::string::npos) {
    std::vector<c10::IValue> items;
    for (const std::string& p : std::vector<std::string>(absl::StrSplit(text, ','))) {
      items.push_back(p == "none" ? c10::IValue() : c10::IValue(std::stod(p)));
    }
    return c10::ivalue::Tuple::create(std::move(items));
  }
  if (absl::SimpleAtod(text, &v)) return v;
  return text;
}

std::vector<int64_t> parse_shape(const std::string& text) {
  std::vector<int64_t> dims;
  if (text == "scalar") return dims;
  for (const std::string& d : std::vector<std::string>(absl::StrSplit(text, ',')))
    dims.push_back(std::stoll(d));
  return dims;
}

Oracle read_oracle(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in, "cannot open ", path, " (BUILD's installed_pytorch_state_keys writes it)");
  Oracle o;
  std::string line;
  std::getline(in, line);
  TORCH_CHECK(line == "dtrain-state-keys 1", path, ": not a state-keys file (", line, ")");
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string tag, a, b;
    ls >> tag;
    if (tag == "torch") {
      ls >> o.torch_version;
    } else if (tag == "absent") {
      ls >> a;
      o.absent.insert(a);
    } else if (tag == "case") {
      o.cases.emplace_back();
      ls >> o.cases.back().name;
    } else if (tag != "end") {
      TORCH_CHECK(!o.cases.empty(), path, ": '", tag, "' before any case");
      KeysCase& c = o.cases.back();
      if (tag == "options") {
        c.options_line = line.substr(std::min(line.size(), size_t{8}));
        while (ls >> a) {
          const size_t eq = a.find('=');
          c.options.insert(a.substr(0, eq), parse_value(a.substr(eq + 1)));
        }
      } else if (tag == "shapes") {
        while (ls >> a) c.shapes.push_back(parse_shape(a));
      } else if (tag == "sparse_grads") {
        c.sparse_grads = true;
      } else if (tag == "steps") {
        ls >> c.steps;
      } else if (tag == "group") {
        ls >> a >> b;
        c.group[a] = b;
      } else if (tag == "state") {
        c.state.insert(line.substr(6));
      } else {
        TORCH_CHECK(false, path, ": unknown line '", line, "'");
      }
    }
  }
  return o;
}

// A value as make_state_keys.py's fmt writes it (every number as a float; "%.17g" rather than
// Python's repr, so numbers are compared as numbers by same_value).
std::string format_value(const c10::IValue& v) {
  if (v.isNone()) return "none";
  if (v.isBool()) return v.toBool() ? "True" : "False";
  if (v.isString()) return v.toStringRef();
  if (v.isInt() || v.isDouble()) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.17g",
                  v.isInt() ? static_cast<double>(v.toInt()) : v.toDouble());
    return buf;
  }
  std::vector<std::string> items;
  if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) items.push_back(format_value(e));
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) items.push_back(format_value(e));
  } else {
    return std::string("<") + v.tagKind() + ">";
  }
  return absl::StrJoin(items, ",");
}

// Whether two formatted values are one value: item by item, numbers compared as numbers.
bool same_value(const std::string& a, const std::string& b) {
  std::vector<std::string> x = absl::StrSplit(a, ','), y = absl::StrSplit(b, ',');
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i) {
    double u = 0, w = 0;
    const bool numbers = absl::SimpleAtod(x[i], &u) && absl::SimpleAtod(y[i], &w);
    if (numbers ? u != w : x[i] != y[i]) return false;
  }
  return true;
}

std::string kind_of(const c10::IValue& v) {
  if (v.isTensor()) {
    switch (v.toTensor().scalar_type()) {
      case at::kFloat:
        return "float32";
      case at::kDouble:
        return "float64";
      case at::kLong:
        return "int64";
      default:
        return c10::toString(v.toTensor().scalar_type());
    }
  }
  if (v.isInt()) return "int";
  if (v.isDouble()) return "float";
  if (v.isNone()) return "NoneType";
  return v.tagKind();
}

std::string shape_of(const c10::IValue& v) {
  if (!v.isTensor()) return "-";
  const at::Tensor& t = v.toTensor();
  if (t.dim() == 0) return "scalar";
  return absl::StrJoin(t.sizes(), ",");
}

// Compares a state dict with the case's, key by key, each difference its own failure.
void expect_same_keys(const KeysCase& want, const c10::IValue& sd) {
  const auto groups = sd.toGenericDict().at("param_groups").toList();
  ASSERT_EQ(groups.size(), 1u);
  const auto group = groups.get(0).toGenericDict();
  EXPECT_TRUE(group.contains("params"));
  std::map<std::string, std::string> got_group;
  for (const auto& kv : group) {
    if (kv.key().toStringRef() != "params") {
      got_group[kv.key().toStringRef()] = format_value(kv.value());
    }
  }
  for (const auto& [key, value] : want.group) {
    auto it = got_group.find(key);
    if (it == got_group.end()) {
      ADD_FAILURE() << "param_groups[0] lacks '" << key << "' (PyTorch writes " << value << ")";
    } else {
      EXPECT_TRUE(same_value(it->second, value))
          << "param_groups[0]['" << key << "'] is " << it->second << ", PyTorch's is " << value;
    }
  }
  for (const auto& [key, value] : got_group) {
    EXPECT_TRUE(want.group.count(key))
        << "param_groups[0] has '" << key << "' (" << value << "), which PyTorch does not write";
  }
  std::set<std::string> got_state;
  for (const auto& entry : sd.toGenericDict().at("state").toGenericDict()) {
    for (const auto& kv : entry.value().toGenericDict()) {
      got_state.insert(std::to_string(entry.key().toInt()) + " " + kv.key().toStringRef() + " " +
                       kind_of(kv.value()) + " " + shape_of(kv.value()));
    }
  }
  for (const std::string& s : want.state) {
    EXPECT_TRUE(got_state.count(s)) << "no state entry '" << s << "' (PARAM KEY KIND SHAPE)";
  }
  for (const std::string& s : got_state) {
    EXPECT_TRUE(want.state.count(s)) << "state entry '" << s << "' is not PyTorch's";
  }
}

std::vector<at::Tensor> make_params(const KeysCase& c) {
  at::manual_seed(7);
  std::vector<at::Tensor> params;
  for (const auto& s : c.shapes) params.push_back(at::randn(s, at::kDouble));
  return params;
}

// The gradients of one step: every parameter's but the last (which never gets one).
std::vector<at::Tensor> make_grads(const KeysCase& c, const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor g = at::randn(params[i].sizes(), at::kDouble);
    if (c.sparse_grads) g = g.to_sparse(1);
    grads.push_back(i + 1 == params.size() ? at::Tensor() : g);
  }
  return grads;
}

c10::IValue functional_state_dict(const KeysCase& c) {
  std::vector<at::Tensor> params = make_params(c);
  auto opt = FunctionalRegistry::global().create(c.name, params, c.options);
  for (int s = 0; s < c.steps; ++s) opt->step(make_grads(c, params));
  return opt->state_dict();
}

// LibTorch's optimizer of the twin `name`, its options PyTorch's defaults with `options` applied.
std::unique_ptr<torch::optim::Optimizer> make_torch_optimizer(const std::string& name,
                                                              std::vector<at::Tensor> params,
                                                              const OptionsDict& options) {
  namespace o = torch::optim;
  std::unique_ptr<o::OptimizerOptions> defaults;
  if (name == "SGD") defaults = std::make_unique<o::SGDOptions>(0.01);
  if (name == "Adam") defaults = std::make_unique<o::AdamOptions>();
  if (name == "AdamW") defaults = std::make_unique<o::AdamWOptions>();
  if (name == "Adagrad") defaults = std::make_unique<o::AdagradOptions>();
  if (name == "RMSprop") defaults = std::make_unique<o::RMSpropOptions>();
  TORCH_CHECK(defaults != nullptr, name, " is not a LibTorch twin");
  const TorchTwin* twin = twin_of(*defaults);
  TORCH_CHECK(twin != nullptr && twin->name == name, "no twin row for ", name);
  twin->apply_options(*defaults, options);
  if (name == "SGD")
    return std::make_unique<o::SGD>(params, dynamic_cast<o::SGDOptions&>(*defaults));
  if (name == "Adam")
    return std::make_unique<o::Adam>(params, dynamic_cast<o::AdamOptions&>(*defaults));
  if (name == "AdamW")
    return std::make_unique<o::AdamW>(params, dynamic_cast<o::AdamWOptions&>(*defaults));
  if (name == "Adagrad")
    return std::make_unique<o::Adagrad>(params, dynamic_cast<o::AdagradOptions&>(*defaults));
  return std::make_unique<o::RMSprop>(params, dynamic_cast<o::RMSpropOptions&>(*defaults));
}

c10::IValue twin_state_dict(const KeysCase& c) {
  std::vector<at::Tensor> params = make_params(c);
  for (auto& p : params) p.requires_grad_();
  auto opt = make_torch_optimizer(c.name, params, c.options);
  for (int s = 0; s < c.steps; ++s) {
    const std::vector<at::Tensor> grads = make_grads(c, params);
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i];
    opt->step();
  }
  return torch_optim_state_dict(*opt);
}

class StateKeysTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { oracle_ = new Oracle(read_oracle(kOracle)); }
  static const Oracle& oracle() { return *oracle_; }
  static Oracle* oracle_;
};
Oracle* StateKeysTest::oracle_ = nullptr;

// Every built-in has cases in the oracle, or the oracle says this PyTorch lacks it: a case
// dropped from make_state_keys.py fails here.
TEST_F(StateKeysTest, OracleCoversEveryBuiltin) {
  std::set<std::string> covered = oracle().absent;
  for (const KeysCase& c : oracle().cases) covered.insert(c.name);
  std::vector<std::string> builtins;
#define DTRAIN_BUILTIN_NAME(T) builtins.push_back(T::option_table().name());
  DTRAIN_BUILTIN_OPTIMIZERS(DTRAIN_BUILTIN_NAME)
#undef DTRAIN_BUILTIN_NAME
  EXPECT_EQ(builtins.size(), 14u);
  for (const std::string& name : builtins) {
    EXPECT_TRUE(covered.count(name)) << name << " has no case in " << kOracle;
  }
  for (const TorchTwin& twin : torch_twins()) {
    EXPECT_TRUE(covered.count(twin.name)) << twin.name << " has no case in " << kOracle;
  }
  std::cout << "PyTorch " << oracle().torch_version << ": " << oracle().cases.size()
            << " cases; absent: " << absl::StrJoin(oracle().absent, ", ") << "\n";
}

TEST_F(StateKeysTest, FunctionalStateDictsHavePyTorchsKeys) {
  for (const KeysCase& c : oracle().cases) {
    SCOPED_TRACE("functional " + c.name + " (" + c.options_line + "), PyTorch " +
                 oracle().torch_version);
    expect_same_keys(c, functional_state_dict(c));
  }
}

TEST_F(StateKeysTest, LibTorchTwinStateDictsHavePyTorchsKeys) {
  int twins = 0;
  for (const KeysCase& c : oracle().cases) {
    const bool is_twin = std::any_of(torch_twins().begin(), torch_twins().end(),
                                     [&](const TorchTwin& t) { return t.name == c.name; });
    if (!is_twin) continue;
    ++twins;
    SCOPED_TRACE("torch::optim::" + c.name + " (" + c.options_line + "), PyTorch " +
                 oracle().torch_version);
    expect_same_keys(c, twin_state_dict(c));
  }
  EXPECT_GE(twins, 5);
}

}  // namespace
}  // namespace dtrain::optim
