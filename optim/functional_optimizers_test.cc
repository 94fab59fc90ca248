#include "optim/functional_optimizers.h"

#include <cstdlib>
#include <thread>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "optim/internal/fused.h"
#include "optim/libtorch_compat.h"
#include "optim/reference_testing.h"
#include "optim/registry.h"

namespace dtrain::optim {
namespace {

using ::testing::HasSubstr;
using testing::read_reference;
using testing::ReferenceCase;
using testing::relative_error;

const char* const kFiles[] = {"sgd", "adam", "adamw", "adagrad", "adadelta", "adamax", "rmsprop", "rprop"};

// The checked-in trajectories (PyTorch 1.13, optim/testdata/), or with DTRAIN_REFERENCE_DIR set
// (functional_optimizers_installed_pytorch_test), the ones the installed PyTorch wrote at build time.
std::string reference_path(const std::string& name) {
  const char* dir = std::getenv("DTRAIN_REFERENCE_DIR");
  return std::string(dir != nullptr && *dir != '\0' ? dir : "optim/testdata/") + name + ".ref";
}

std::string registry_name(const std::string& case_name) { return case_name.substr(0, case_name.rfind('_')); }

enum class Layout { kContiguous, kStrided };

// A parameter holding `init` in `dtype`; kStrided makes it non-contiguous so the ATen path runs.
at::Tensor make_param(const at::Tensor& init, at::ScalarType dtype, Layout layout) {
  if (layout == Layout::kContiguous) return init.to(dtype).clone();
  std::vector<int64_t> shape = init.sizes().vec();
  shape.push_back(2);
  at::Tensor p = at::zeros(shape, dtype).select(-1, 0);
  p.copy_(init);
  return p;
}

// Runs one reference case; returns the worst relative error over all steps and parameters.
double run_case(const ReferenceCase& c, at::ScalarType dtype, Layout layout,
                std::unique_ptr<FunctionalOptimizer>* out = nullptr) {
  std::vector<at::Tensor> params;
  for (const auto& t : c.init) params.push_back(make_param(t, dtype, layout));
  auto opt = FunctionalRegistry::global().create(registry_name(c.name), params, c.options);
  double worst = 0;
  for (int step = 0; step < c.steps; ++step) {
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < params.size(); ++i) {
      grads.push_back(c.missing[step][i] ? at::Tensor() : c.grads[step][i].to(dtype));
    }
    opt->step(grads);
    const auto& want = dtype == at::kDouble ? c.params64[step] : c.params32[step];
    for (size_t i = 0; i < params.size(); ++i) worst = std::max(worst, relative_error(params[i], want[i]));
  }
  if (out) *out = std::move(opt);
  return worst;
}

TEST(FunctionalOptimizersTest, MatchPyTorchFloat32) {
  for (const char* file : kFiles) {
    for (const ReferenceCase& c : read_reference(reference_path(file))) {
      SCOPED_TRACE(c.name);
      EXPECT_LE(run_case(c, at::kFloat, Layout::kContiguous), 1e-6) << "fused float32 path";
      EXPECT_LE(run_case(c, at::kFloat, Layout::kStrided), 1e-6) << "ATen float32 path";
    }
  }
}

TEST(FunctionalOptimizersTest, MatchPyTorchFloat64) {
  for (const char* file : kFiles) {
    for (const ReferenceCase& c : read_reference(reference_path(file))) {
      SCOPED_TRACE(c.name);
      EXPECT_LE(run_case(c, at::kDouble, Layout::kContiguous), 1e-12) << "fused float64 path";
      EXPECT_LE(run_case(c, at::kDouble, Layout::kStrided), 1e-12) << "ATen float64 path";
    }
  }
}

TEST(FunctionalOptimizersTest, StateDictMatchesPyTorchState) {
  for (const char* file : kFiles) {
    for (const ReferenceCase& c : read_reference(reference_path(file))) {
      SCOPED_TRACE(c.name);
      std::unique_ptr<FunctionalOptimizer> opt;
      run_case(c, at::kDouble, Layout::kContiguous, &opt);
      auto sd = opt->state_dict().toGenericDict();
      auto state = sd.at("state").toGenericDict();
      size_t entries = 0;
      for (const auto& kv : state) entries += kv.value().toGenericDict().size();
      // A None entry (1.13's SGD momentum_buffer, in references PyTorch 1.13 wrote) is absent from
      // state dicts, as in PyTorch 2.x.
      auto absent = [](const at::Tensor& want) { return !want.defined(); };
      size_t expected = 0;
      for (const auto& entry : c.final_state) expected += absent(entry.second) ? 0 : 1;
      EXPECT_EQ(entries, expected) << "number of (param, key) state entries";
      for (const auto& [where, want] : c.final_state) {
        const auto& [param, key] = where;
        if (absent(want)) continue;
        ASSERT_TRUE(state.contains(static_cast<int64_t>(param))) << "param " << param;
        auto entry = state.at(static_cast<int64_t>(param)).toGenericDict();
        ASSERT_TRUE(entry.contains(key)) << "param " << param << " key " << key;
        const c10::IValue v = entry.at(key);
        if (!want.defined()) {
          EXPECT_TRUE(v.isNone()) << key;
        } else if (key == "step") {
          const double got = v.isTensor() ? v.toTensor().item<double>() : static_cast<double>(v.toInt());
          EXPECT_EQ(got, want.item<double>()) << "param " << param;
        } else {
          EXPECT_LE(relative_error(v.toTensor().reshape(-1), want), 1e-12) << "param " << param << " " << key;
        }
      }
      // The param group carries PyTorch's keys and the parameter indices.
      auto group = sd.at("param_groups").toList().get(0).toGenericDict();
      EXPECT_TRUE(group.contains("lr"));
      EXPECT_EQ(group.at("params").toList().size(), 3u);
    }
  }
}

TEST(FunctionalOptimizersTest, StateDictRoundTripContinuesTheTrajectory) {
  // Run 20 steps, save, load into a fresh optimizer on copies of the parameters, then both run to
  // 50 steps: the trajectories must stay identical.
  for (const char* file : kFiles) {
    const ReferenceCase c = read_reference(reference_path(file)).back();
    SCOPED_TRACE(c.name);
    std::vector<at::Tensor> a;
    for (const auto& t : c.init) a.push_back(t.clone());
    auto opt_a = FunctionalRegistry::global().create(registry_name(c.name), a, c.options);
    auto grads_at = [&](int step) {
      std::vector<at::Tensor> g;
      for (size_t i = 0; i < a.size(); ++i) g.push_back(c.missing[step][i] ? at::Tensor() : c.grads[step][i]);
      return g;
    };
    for (int s = 0; s < 20; ++s) opt_a->step(grads_at(s));
    std::vector<at::Tensor> b;
    for (const auto& t : a) b.push_back(t.clone());
    // Defaults for everything, then load: options come from the state dict too.
    OptionsDict minimal = new_options_dict();
    if (c.options.contains("lr")) minimal.insert("lr", c.options.at("lr"));
    auto opt_b = FunctionalRegistry::global().create(registry_name(c.name), b, minimal);
    opt_b->load_state_dict(opt_a->state_dict());
    for (int s = 20; s < c.steps; ++s) {
      opt_a->step(grads_at(s));
      opt_b->step(grads_at(s));
    }
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].equal(b[i])) << "param " << i;
  }
}

TEST(FunctionalOptimizersTest, LoadStateDictRejectsMismatches) {
  std::vector<at::Tensor> params = {at::zeros({2, 2}), at::zeros({3})};
  FunctionalAdam adam(params, AdamOptions());
  adam.step({at::ones({2, 2}), at::ones({3})});
  auto sd = adam.state_dict();
  FunctionalAdam other({at::zeros({2, 2})}, AdamOptions());
  try {
    other.load_state_dict(sd);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("parameter group of 2 parameters, this optimizer has 1"));
  }
  FunctionalAdam swapped({at::zeros({3}), at::zeros({2, 2})}, AdamOptions());
  try {
    swapped.load_state_dict(sd);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("state 'exp_avg' of parameter 0 has shape [2, 2], the parameter has shape [3]"));
  }
}

TEST(FunctionalOptimizersTest, MissingGradientLeavesParameterAndStateUntouched) {
  at::Tensor w = at::ones({4}), b = at::ones({2});
  FunctionalAdam adam({w, b}, AdamOptions().lr(0.1));
  adam.step({at::ones({4}), at::Tensor()});
  EXPECT_TRUE(b.equal(at::ones({2})));
  EXPECT_TRUE(adam.has_state(0));
  EXPECT_FALSE(adam.has_state(1));
  adam.step_param(b, at::ones({2}));
  EXPECT_FALSE(b.equal(at::ones({2})));
  EXPECT_TRUE(adam.has_state(1));
}

TEST(FunctionalOptimizersTest, LengthMismatchNamesBothLengths) {
  FunctionalSGD sgd({at::zeros({1}), at::zeros({1})}, SGDOptions(0.1));
  try {
    sgd.step({at::zeros({1})});
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("Params length: 2. Gradients length: 1"));
  }
  try {
    sgd.step({at::zeros({2}), at::Tensor()});
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("gradient 0 has shape [2] but its parameter has shape [1]"));
  }
}

void expect_error(const std::function<void()>& f, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "expected: " << message;
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr(message));
  }
}

TEST(FunctionalOptimizersTest, RejectsInvalidHyperParametersWithPyTorchMessages) {
  std::vector<at::Tensor> p = {at::zeros({1})};
  expect_error([&] { FunctionalSGD(p, SGDOptions(-0.1)); }, "Invalid learning rate: -0.1");
  expect_error([&] { FunctionalSGD(p, SGDOptions(0.1).momentum(-1)); }, "Invalid momentum value: -1.0");
  expect_error([&] { FunctionalSGD(p, SGDOptions(0.1).nesterov(true)); },
               "Nesterov momentum requires a momentum and zero dampening");
  expect_error([&] { FunctionalAdam(p, AdamOptions().betas({1.0, 0.999})); }, "Invalid beta parameter at index 0: 1.0");
  expect_error([&] { FunctionalAdamW(p, AdamWOptions().betas({0.9, -0.1})); }, "Invalid beta parameter at index 1: -0.1");
  expect_error([&] { FunctionalAdam(p, AdamOptions().eps(-1e-8)); }, "Invalid epsilon value: -1e-08");
  expect_error([&] { FunctionalAdamax(p, AdamaxOptions().weight_decay(-1)); }, "Invalid weight_decay value: -1.0");
  expect_error([&] { FunctionalAdagrad(p, AdagradOptions().lr_decay(-1)); }, "Invalid lr_decay value: -1.0");
  expect_error([&] { FunctionalAdagrad(p, AdagradOptions().initial_accumulator_value(-1)); },
               "Invalid initial_accumulator_value value: -1.0");
  expect_error([&] { FunctionalAdadelta(p, AdadeltaOptions().rho(1.5)); }, "Invalid rho value: 1.5");
  expect_error([&] { FunctionalRMSprop(p, RMSpropOptions().alpha(-0.5)); }, "Invalid alpha value: -0.5");
  expect_error([&] { FunctionalRprop(p, RpropOptions().etas({1.5, 1.2})); }, "Invalid eta values: 1.5, 1.2");
  // Setting options later is validated the same way, and leaves the old options on error.
  FunctionalAdam adam(p, AdamOptions().lr(0.5));
  expect_error([&] { adam.set_lr(-1); }, "Invalid learning rate: -1.0");
  EXPECT_EQ(adam.lr(), 0.5);
  OptionsDict bad = new_options_dict();
  bad.insert("lr", 0.25);
  bad.insert("betaz", 1.0);
  expect_error([&] { adam.set_options(bad); }, "Adam got an unexpected option 'betaz'");
  EXPECT_EQ(adam.lr(), 0.5);
  OptionsDict capturable = new_options_dict();
  capturable.insert("capturable", true);
  expect_error([&] { adam.set_options(capturable); }, "capturable=True is not supported");
}

OptionsDict dict_of(const std::vector<std::pair<const char*, c10::IValue>>& kv) {
  OptionsDict d = new_options_dict();
  for (const auto& [k, v] : kv) d.insert(k, v);
  return d;
}

// amsgrad (Adam, AdamW), momentum and centered (RMSprop) switched on after a parameter has state:
// PyTorch raises KeyError for the missing state entry; dtrain raises before changing anything, on
// the fused and the ATen path. SGD's momentum may be switched on later (PyTorch starts the buffer).
TEST(FunctionalOptimizersTest, SwitchingOnStatefulOptionsAfterTheFirstStepIsAnError) {
  const std::vector<std::tuple<const char*, OptionsDict, const char*>> cases = {
      {"Adam", dict_of({{"amsgrad", true}}), "Adam: amsgrad=True needs the state 'max_exp_avg_sq', which parameter 0"},
      {"AdamW", dict_of({{"amsgrad", true}}), "AdamW: amsgrad=True needs the state 'max_exp_avg_sq', which parameter 0"},
      {"RMSprop", dict_of({{"momentum", 0.9}}), "RMSprop: momentum > 0 needs the state 'momentum_buffer'"},
      {"RMSprop", dict_of({{"centered", true}}), "RMSprop: centered=True needs the state 'grad_avg'"},
  };
  auto step_of = [](const FunctionalOptimizer& o) {
    const c10::IValue v = o.state_dict().toGenericDict().at("state").toGenericDict().at(0).toGenericDict().at("step");
    return v.isTensor() ? v.toTensor().item<double>() : v.toInt();
  };
  for (const auto& [name, later, message] : cases) {
    for (Layout layout : {Layout::kContiguous, Layout::kStrided}) {
      SCOPED_TRACE(std::string(name) + (layout == Layout::kContiguous ? " fused" : " aten"));
      std::vector<at::Tensor> params = {make_param(at::ones({3}), at::kFloat, layout)};
      auto opt = FunctionalRegistry::global().create(name, params, dict_of({{"lr", 0.1}}));
      opt->step({at::ones({3})});
      const at::Tensor before = params[0].clone();
      opt->set_options(later);
      expect_error([&] { opt->step({at::ones({3})}); }, message);
      EXPECT_TRUE(params[0].equal(before));
      EXPECT_EQ(step_of(*opt), 1);
      // A parameter without state yet starts it with the new options.
      auto fresh = FunctionalRegistry::global().create(name, {make_param(at::ones({3}), at::kFloat, layout)}, later);
      fresh->step({at::ones({3})});
    }
  }
  at::Tensor w = at::zeros({2});
  FunctionalSGD sgd({w}, SGDOptions(1.0));
  sgd.step({at::ones({2})});
  sgd.set_options(SGDOptions(sgd.options()).momentum(0.9));
  sgd.step({at::ones({2})});  // the buffer starts as the gradient: w = -1 - 1
  EXPECT_TRUE(w.equal(at::full({2}, -2.0)));
}

// Switching momentum (SGD) or amsgrad (Adam) off again leaves the buffer unused and untouched, as
// in PyTorch: the fused kernels follow the options, not the presence of the buffer.
TEST(FunctionalOptimizersTest, SwitchingStatefulOptionsOffIgnoresTheirState) {
  const std::vector<std::tuple<const char*, OptionsDict, OptionsDict>> cases = {
      {"SGD", dict_of({{"lr", 0.1}, {"momentum", 0.9}, {"dampening", 0.5}}), dict_of({{"momentum", 0.0}})},
      {"Adam", dict_of({{"lr", 0.1}, {"amsgrad", true}}), dict_of({{"amsgrad", false}})},
      {"AdamW", dict_of({{"lr", 0.1}, {"amsgrad", true}}), dict_of({{"amsgrad", false}})},
  };
  for (const auto& [name, first, later] : cases) {
    SCOPED_TRACE(name);
    at::manual_seed(5);
    const at::Tensor init = at::randn({37});
    std::vector<at::Tensor> fused = {make_param(init, at::kFloat, Layout::kContiguous)};
    std::vector<at::Tensor> aten = {make_param(init, at::kFloat, Layout::kStrided)};
    auto a = FunctionalRegistry::global().create(name, fused, first);
    auto b = FunctionalRegistry::global().create(name, aten, first);
    for (int s = 0; s < 6; ++s) {
      if (s == 3) a->set_options(later), b->set_options(later);
      const at::Tensor g = at::randn({37});
      a->step({g});
      b->step({g});
    }
    EXPECT_LE(relative_error(fused[0], aten[0]), 1e-6);
    auto state = [](FunctionalOptimizer& o) { return o.state_dict().toGenericDict().at("state").toGenericDict().at(0).toGenericDict(); };
    for (const auto& kv : state(*a)) {
      if (!kv.value().isTensor()) continue;
      EXPECT_LE(relative_error(kv.value().toTensor(), state(*b).at(kv.key()).toTensor()), 1e-6) << kv.key().toStringRef();
    }
  }
}

TEST(FunctionalOptimizersTest, SchedulerStyleLrChangesApply) {
  at::Tensor a = at::zeros({3}), b = at::zeros({3});
  FunctionalSGD sgd({a}, SGDOptions(1.0));
  sgd.step({at::ones({3})});
  sgd.set_lr(0.5);
  sgd.step({at::ones({3})});
  EXPECT_TRUE(a.allclose(at::full({3}, -1.5)));
  EXPECT_EQ(sgd.options_dict().at("lr").toDouble(), 0.5);
}

// LibTorch's own torch::optim, stepped on the same inputs, where it has the optimizer and the
// options (LibTorch 1.13 has no `maximize`).
TEST(FunctionalOptimizersTest, MatchLibTorchOptim) {
  struct Pair {
    const char* file;
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>, const OptionsDict&)> make;
  };
  auto d = [](const OptionsDict& o, const char* k, double def) { return o.contains(k) ? o.at(k).toDouble() : def; };
  auto flag = [](const OptionsDict& o, const char* k) { return o.contains(k) && o.at(k).toBool(); };
  auto betas = [](const OptionsDict& o, std::tuple<double, double> def) {
    if (!o.contains("betas")) return def;
    auto e = o.at("betas").toTupleRef().elements();
    return std::make_tuple(e[0].toDouble(), e[1].toDouble());
  };
  std::vector<Pair> pairs = {
      {"sgd", [&](auto p, const OptionsDict& o) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(d(o, "lr", 0)).momentum(d(o, "momentum", 0))
             .dampening(d(o, "dampening", 0)).weight_decay(d(o, "weight_decay", 0)).nesterov(flag(o, "nesterov")));
       }},
      {"adam", [&](auto p, const OptionsDict& o) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(d(o, "lr", 1e-3)).betas(betas(o, {0.9, 0.999}))
             .eps(d(o, "eps", 1e-8)).weight_decay(d(o, "weight_decay", 0)).amsgrad(flag(o, "amsgrad")));
       }},
      {"adamw", [&](auto p, const OptionsDict& o) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(d(o, "lr", 1e-3)).betas(betas(o, {0.9, 0.999}))
             .eps(d(o, "eps", 1e-8)).weight_decay(d(o, "weight_decay", 1e-2)).amsgrad(flag(o, "amsgrad")));
       }},
      {"adagrad", [&](auto p, const OptionsDict& o) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(d(o, "lr", 1e-2)).lr_decay(d(o, "lr_decay", 0))
             .weight_decay(d(o, "weight_decay", 0)).initial_accumulator_value(d(o, "initial_accumulator_value", 0)).eps(d(o, "eps", 1e-10)));
       }},
      {"rmsprop", [&](auto p, const OptionsDict& o) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions(d(o, "lr", 1e-2)).alpha(d(o, "alpha", 0.99))
             .eps(d(o, "eps", 1e-8)).weight_decay(d(o, "weight_decay", 0)).momentum(d(o, "momentum", 0)).centered(flag(o, "centered")));
       }},
  };
  int compared = 0;
  for (const Pair& pair : pairs) {
    for (const ReferenceCase& c : read_reference(reference_path(pair.file))) {
      if (flag(c.options, "maximize")) continue;
      SCOPED_TRACE(c.name);
      std::vector<at::Tensor> ours, theirs;
      for (const auto& t : c.init) {
        ours.push_back(t.to(at::kFloat));
        theirs.push_back(t.to(at::kFloat).requires_grad_());
      }
      auto functional = FunctionalRegistry::global().create(registry_name(c.name), ours, c.options);
      auto libtorch = pair.make(theirs, c.options);
      double worst = 0;
      for (int step = 0; step < c.steps; ++step) {
        std::vector<at::Tensor> grads;
        for (size_t i = 0; i < ours.size(); ++i) {
          grads.push_back(c.missing[step][i] ? at::Tensor() : c.grads[step][i].to(at::kFloat));
          theirs[i].mutable_grad() = grads.back().defined() ? grads.back().clone() : at::Tensor();
        }
        functional->step(grads);
        libtorch->step();
        for (size_t i = 0; i < ours.size(); ++i) worst = std::max(worst, relative_error(ours[i], theirs[i].detach()));
      }
      EXPECT_LE(worst, 1e-6);
      ++compared;
    }
  }
  EXPECT_GE(compared, 10);
}

TEST(FunctionalOptimizersTest, IndependentInstancesStepConcurrently) {
  // Four optimizers on four threads, each against the same optimizer run serially.
  const ReferenceCase c = read_reference(reference_path("adam"))[2];
  auto run = [&](std::vector<at::Tensor>& params) {
    auto opt = FunctionalRegistry::global().create("Adam", params, c.options);
    for (int step = 0; step < c.steps; ++step) {
      std::vector<at::Tensor> grads;
      for (size_t i = 0; i < params.size(); ++i) grads.push_back(c.grads[step][i].to(at::kFloat) * (1.0 + 0.1 * i));
      opt->step(grads);
    }
  };
  std::vector<std::vector<at::Tensor>> serial(4), parallel(4);
  for (int k = 0; k < 4; ++k) {
    for (const auto& t : c.init) {
      serial[k].push_back(t.to(at::kFloat) * (k + 1));
      parallel[k].push_back(t.to(at::kFloat) * (k + 1));
    }
    run(serial[k]);
  }
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) threads.emplace_back([&, k] { run(parallel[k]); });
  for (auto& t : threads) t.join();
  for (int k = 0; k < 4; ++k)
    for (size_t i = 0; i < serial[k].size(); ++i) EXPECT_TRUE(serial[k][i].equal(parallel[k][i])) << k << "," << i;
}

TEST(FunctionalOptimizersTest, FusedMultiTensorPathCoversLargeTensors) {
  // Tensors spanning several parallel chunks (and chunks spanning several tensors) give the same
  // result as the ATen path.
  std::vector<at::Tensor> fused, aten;
  at::manual_seed(3);
  for (int64_t n : {int64_t{1} << 18, int64_t{5}, int64_t{100000}, int64_t{1}}) {
    at::Tensor t = at::randn({n});
    fused.push_back(t.clone());
    aten.push_back(make_param(t, at::kFloat, Layout::kStrided));
  }
  FunctionalAdamW a(fused, AdamWOptions().lr(0.01).amsgrad(true));
  FunctionalAdamW b(aten, AdamWOptions().lr(0.01).amsgrad(true));
  for (int s = 0; s < 5; ++s) {
    std::vector<at::Tensor> g;
    for (const auto& p : fused) g.push_back(at::randn_like(p));
    a.step(g);
    b.step(g);
  }
  for (size_t i = 0; i < fused.size(); ++i) EXPECT_LE(relative_error(fused[i], aten[i]), 1e-6) << i;
}

// The AVX2 build of the fused kernels (used on CPUs that have AVX2) and the baseline build give
// bit-identical parameters and state for every optimizer and option, float and double, with sizes
// that leave vector remainders.
TEST(FunctionalOptimizersTest, Avx2KernelsAreBitIdenticalToTheBaseline) {
  if (!internal::cpu_has_avx2()) GTEST_SKIP() << "this CPU has no AVX2: only the baseline kernels run";
  struct Config {
    const char* name;
    std::vector<std::pair<const char*, c10::IValue>> options;
  };
  const std::vector<Config> configs = {
      {"SGD", {{"lr", 0.1}, {"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 0.01}}},
      {"SGD", {{"lr", 0.1}, {"momentum", 0.5}, {"dampening", 0.3}, {"maximize", true}}},
      {"Adam", {{"lr", 0.01}, {"weight_decay", 0.1}}},
      {"Adam", {{"lr", 0.01}, {"amsgrad", true}}},
      {"AdamW", {{"lr", 0.01}, {"weight_decay", 0.05}}},
      {"Adagrad", {{"lr", 0.1}, {"lr_decay", 0.01}, {"weight_decay", 0.1}}},
      {"Adadelta", {{"lr", 1.0}, {"weight_decay", 0.1}}},
      {"Adamax", {{"lr", 0.02}, {"weight_decay", 0.1}}},
      {"RMSprop", {{"lr", 0.01}, {"centered", true}, {"momentum", 0.5}}},
      {"RMSprop", {{"lr", 0.01}, {"weight_decay", 0.1}}},
      {"Rprop", {{"lr", 0.01}}},
  };
  for (const Config& c : configs) {
    for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
      std::vector<std::vector<at::Tensor>> params(2);
      at::manual_seed(11);
      for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{37}, int64_t{100003}}) {
        at::Tensor t = at::randn({n}, dtype);
        params[0].push_back(t.clone());
        params[1].push_back(t.clone());
      }
      OptionsDict o = new_options_dict();
      for (const auto& [k, v] : c.options) o.insert(k, v);
      auto avx2 = FunctionalRegistry::global().create(c.name, params[0], o);
      auto base = FunctionalRegistry::global().create(c.name, params[1], o);
      for (int s = 0; s < 4; ++s) {
        std::vector<at::Tensor> g;
        for (const auto& p : params[0]) g.push_back(at::randn_like(p));
        avx2->step(g);
        internal::baseline_kernels_only() = true;
        base->step(g);
        internal::baseline_kernels_only() = false;
      }
      for (size_t i = 0; i < params[0].size(); ++i) {
        EXPECT_TRUE(params[0][i].equal(params[1][i])) << c.name << " " << c10::toString(dtype) << " param " << i
                                                      << " differs by " << (params[0][i] - params[1][i]).abs().max();
      }
    }
  }
}

}  // namespace
}  // namespace dtrain::optim
