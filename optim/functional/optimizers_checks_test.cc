// The built-in functional optimizers' behaviour beyond the PyTorch trajectories
// (functional_optimizers_test.cc has those): errors with PyTorch's messages, state that options
// need, state dict types and loading, the fused kernels' coverage and their AVX2 build.
#include "optim/functional/optimizers.h"

#include <functional>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "optim/functional/internal/fused.h"
#include "optim/functional/registry.h"
#include "optim/functional/testing/reference.h"
#include "optim/libtorch_compat.h"
#include "testing/test_util.h"

namespace dtrain::optim {
namespace {

using ::testing::HasSubstr;
using testing::Layout;
using testing::make_param;
using testing::relative_error;

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
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("parameter group of 2 parameters, this optimizer has 1"));
  }
  FunctionalAdam swapped({at::zeros({3}), at::zeros({2, 2})}, AdamOptions());
  try {
    swapped.load_state_dict(sd);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(
        e.what_without_backtrace(),
        HasSubstr("state 'exp_avg' of parameter 0 has shape [2, 2], the parameter has shape [3]"));
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
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("gradient 0 has shape [2] but its parameter has shape [1]"));
  }
}

using test_util::expect_error;

TEST(FunctionalOptimizersTest, RejectsInvalidHyperParametersWithPyTorchMessages) {
  std::vector<at::Tensor> p = {at::zeros({1})};
  expect_error([&] { FunctionalSGD(p, SGDOptions(-0.1)); }, "Invalid learning rate: -0.1");
  expect_error([&] { FunctionalSGD(p, SGDOptions(0.1).momentum(-1)); },
               "Invalid momentum value: -1.0");
  expect_error([&] { FunctionalSGD(p, SGDOptions(0.1).nesterov(true)); },
               "Nesterov momentum requires a momentum and zero dampening");
  expect_error(
      [&] {
        FunctionalAdam(p, AdamOptions().betas({1.0, 0.999}));
      },
      "Invalid beta parameter at index 0: 1.0");
  expect_error(
      [&] {
        FunctionalAdamW(p, AdamWOptions().betas({0.9, -0.1}));
      },
      "Invalid beta parameter at index 1: -0.1");
  expect_error([&] { FunctionalAdam(p, AdamOptions().eps(-1e-8)); },
               "Invalid epsilon value: -1e-08");
  expect_error([&] { FunctionalAdamax(p, AdamaxOptions().weight_decay(-1)); },
               "Invalid weight_decay value: -1.0");
  expect_error([&] { FunctionalAdagrad(p, AdagradOptions().lr_decay(-1)); },
               "Invalid lr_decay value: -1.0");
  expect_error([&] { FunctionalAdagrad(p, AdagradOptions().initial_accumulator_value(-1)); },
               "Invalid initial_accumulator_value value: -1.0");
  expect_error([&] { FunctionalAdadelta(p, AdadeltaOptions().rho(1.5)); },
               "Invalid rho value: 1.5");
  expect_error([&] { FunctionalRMSprop(p, RMSpropOptions().alpha(-0.5)); },
               "Invalid alpha value: -0.5");
  expect_error(
      [&] {
        FunctionalRprop(p, RpropOptions().etas({1.5, 1.2}));
      },
      "Invalid eta values: 1.5, 1.2");
  expect_error([&] { FunctionalNAdam(p, NAdamOptions().momentum_decay(-1)); },
               "Invalid momentum_decay value: -1.0");
  expect_error(
      [&] {
        FunctionalNAdam(p, NAdamOptions().betas({0.9, 1.0}));
      },
      "Invalid beta parameter at index 1: 1.0");
  expect_error([&] { FunctionalRAdam(p, RAdamOptions().eps(-1)); }, "Invalid epsilon value: -1.0");
  expect_error([&] { FunctionalASGD(p, ASGDOptions().lr(-0.5)); }, "Invalid learning rate: -0.5");
  expect_error([&] { FunctionalASGD(p, ASGDOptions().weight_decay(-0.5)); },
               "Invalid weight_decay value: -0.5");
  expect_error([&] { FunctionalAdafactor(p, AdafactorOptions().lr(-1)); },
               "Learning rate should be >= 0 but is: -1.0");
  expect_error([&] { FunctionalAdafactor(p, AdafactorOptions().beta2_decay(0.5)); },
               "beta2_decay should be <= 0 but is: 0.5");
  expect_error(
      [&] {
        FunctionalAdafactor(p, AdafactorOptions().eps({-1.0, 1e-3}));
      },
      "epsilon1 should be >= 0 but is: -1.0");
  expect_error(
      [&] {
        FunctionalAdafactor(p, AdafactorOptions().eps({std::nullopt, -2.0}));
      },
      "epsilon2 should be >= 0 but is: -2.0");
  expect_error([&] { FunctionalAdafactor(p, AdafactorOptions().d(0.5)); },
               "Clipping threshold d should be >= 1 but is: 0.5");
  expect_error([&] { FunctionalAdafactor(p, AdafactorOptions().weight_decay(-1)); },
               "weight_decay should be >= 0 but is: -1.0");
  expect_error([&] { FunctionalSparseAdam(p, SparseAdamOptions().lr(0)); },
               "Invalid learning rate: 0.0");
  expect_error([&] { FunctionalSparseAdam(p, SparseAdamOptions().eps(0)); },
               "Invalid epsilon value: 0.0");
  const std::vector<at::Tensor> matrix = {at::zeros({2, 3})};
  expect_error([&] { FunctionalMuon(matrix, MuonOptions().lr(-1)); },
               "Learning rate should be >= 0 but is: -1.0");
  expect_error([&] { FunctionalMuon(matrix, MuonOptions().momentum(-1)); },
               "momentum should be >= 0 but is: -1.0");
  expect_error([&] { FunctionalMuon(matrix, MuonOptions().weight_decay(-1)); },
               "weight decay should be >= 0 but is: -1.0");
  expect_error([&] { FunctionalMuon(matrix, MuonOptions().adjust_lr_fn("sqrt")); },
               "Adjust learning rate function sqrt is not supported");
  expect_error([&] { FunctionalMuon(matrix, MuonOptions().ns_steps(100)); },
               "Number of steps must be less than 100 for computational efficiency");
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
      {"Adam", dict_of({{"amsgrad", true}}),
       "Adam: amsgrad=True needs the state 'max_exp_avg_sq', which parameter 0"},
      {"AdamW", dict_of({{"amsgrad", true}}),
       "AdamW: amsgrad=True needs the state 'max_exp_avg_sq', which parameter 0"},
      {"RMSprop", dict_of({{"momentum", 0.9}}),
       "RMSprop: momentum > 0 needs the state 'momentum_buffer'"},
      {"RMSprop", dict_of({{"centered", true}}),
       "RMSprop: centered=True needs the state 'grad_avg'"},
  };
  auto step_of = [](const FunctionalOptimizer& o) {
    const c10::IValue v =
        o.state_dict().toGenericDict().at("state").toGenericDict().at(0).toGenericDict().at("step");
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
      auto fresh = FunctionalRegistry::global().create(
          name, {make_param(at::ones({3}), at::kFloat, layout)}, later);
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
      {"SGD", dict_of({{"lr", 0.1}, {"momentum", 0.9}, {"dampening", 0.5}}),
       dict_of({{"momentum", 0.0}})},
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
    auto state = [](FunctionalOptimizer& o) {
      return o.state_dict().toGenericDict().at("state").toGenericDict().at(0).toGenericDict();
    };
    for (const auto& kv : state(*a)) {
      if (!kv.value().isTensor()) continue;
      EXPECT_LE(relative_error(kv.value().toTensor(), state(*b).at(kv.key()).toTensor()), 1e-6)
          << kv.key().toStringRef();
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
  if (!internal::cpu_has_avx2())
    GTEST_SKIP() << "this CPU has no AVX2: only the baseline kernels run";
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
      {"NAdam", {{"lr", 0.01}, {"weight_decay", 0.1}}},
      {"NAdam",
       {{"lr", 0.01}, {"weight_decay", 0.1}, {"decoupled_weight_decay", true}, {"maximize", true}}},
      {"RAdam", {{"lr", 0.01}, {"weight_decay", 0.1}}},  // rectified from step 6 on
      {"RAdam",
       {{"lr", 0.01}, {"weight_decay", 0.1}, {"decoupled_weight_decay", true}, {"maximize", true}}},
      {"ASGD", {{"lr", 0.01}, {"t0", 1.0}, {"weight_decay", 0.1}}},
      {"ASGD", {{"lr", 0.01}, {"maximize", true}}},
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
      for (int s = 0; s < 8; ++s) {
        std::vector<at::Tensor> g;
        for (const auto& p : params[0]) g.push_back(at::randn_like(p));
        avx2->step(g);
        internal::baseline_kernels_only() = true;
        base->step(g);
        internal::baseline_kernels_only() = false;
      }
      for (size_t i = 0; i < params[0].size(); ++i) {
        EXPECT_TRUE(params[0][i].equal(params[1][i]))
            << c.name << " " << c10::toString(dtype) << " param " << i << " differs by "
            << (params[0][i] - params[1][i]).abs().max();
      }
    }
  }
}

// PyTorch 2.x keeps "step" as a 0-dim float32 tensor for every optimizer that counts steps but
// SparseAdam (a Python int); dtrain's state dicts hold the same types (RMSprop, Adadelta and Rprop
// used to hold an int, PyTorch 1.13's format).
TEST(FunctionalOptimizersTest, StepIsAFloat32TensorAsInPyTorch2) {
  for (const char* name : {"Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop", "Rprop",
                           "NAdam", "RAdam", "ASGD", "Adafactor"}) {
    SCOPED_TRACE(name);
    std::vector<at::Tensor> params = {at::zeros({3})};
    auto opt = FunctionalRegistry::global().create(name, params, dict_of({{"lr", 0.1}}));
    opt->step({at::ones({3})});
    opt->step({at::ones({3})});
    const c10::IValue step =
        opt->state_dict().toGenericDict().at("state").toGenericDict().at(0).toGenericDict().at(
            "step");
    ASSERT_TRUE(step.isTensor()) << "step is a " << step.tagKind();
    EXPECT_EQ(step.toTensor().scalar_type(), at::kFloat);
    EXPECT_EQ(step.toTensor().dim(), 0);
    EXPECT_EQ(step.toTensor().item<double>(), 2.0);
  }
}

// NAdam's mu_product is a float32 CPU scalar when the state starts (also for float64 parameters);
// PyTorch's load_state_dict casts every state tensor but "step" to its parameter's dtype, so after
// loading it is float64 there -- and in dtrain. A shape that is not a scalar is refused.
TEST(FunctionalOptimizersTest, LoadStateDictCastsScalarStateToTheParameterDtype) {
  std::vector<at::Tensor> params = {at::zeros({3}, at::kDouble)};
  FunctionalNAdam nadam(params, NAdamOptions());
  nadam.step({at::ones({3}, at::kDouble)});
  auto entry = [](const FunctionalOptimizer& o) {
    return o.state_dict().toGenericDict().at("state").toGenericDict().at(0).toGenericDict();
  };
  const at::Tensor mu_product = entry(nadam).at("mu_product").toTensor();
  EXPECT_EQ(mu_product.scalar_type(), at::kFloat);
  EXPECT_EQ(mu_product.dim(), 0);
  FunctionalNAdam loaded({at::zeros({3}, at::kDouble)}, NAdamOptions());
  loaded.load_state_dict(nadam.state_dict());
  EXPECT_EQ(entry(loaded).at("mu_product").toTensor().scalar_type(), at::kDouble);
  EXPECT_EQ(entry(loaded).at("mu_product").toTensor().item<double>(), mu_product.item<double>());
  loaded.step({at::ones({3}, at::kDouble)});  // and steps with it

  c10::IValue sd = nadam.state_dict();
  sd.toGenericDict().at("state").toGenericDict().at(0).toGenericDict().insert_or_assign(
      "mu_product", at::ones({3}));
  expect_error([&] { loaded.load_state_dict(sd); },
               "state 'mu_product' of parameter 0 has shape [3], NAdam keeps it with shape [] for "
               "a parameter of "
               "shape [3]");
}

// The param group of each of torch.optim's optimizers that torch.distributed.optim has no
// functional form of, built with its defaults: PyTorch 2.14's keys, in its order, and values.
TEST(FunctionalOptimizersTest, OptionsDictsArePyTorchParamGroups) {
  const c10::IValue none;
  auto pair = [](c10::IValue a, c10::IValue b) {
    return c10::ivalue::Tuple::create({std::move(a), std::move(b)});
  };
  const std::vector<std::pair<const char*, std::vector<std::pair<const char*, c10::IValue>>>>
      groups = {
          {"NAdam",
           {{"lr", 0.002},
            {"betas", pair(0.9, 0.999)},
            {"eps", 1e-08},
            {"weight_decay", 0.0},
            {"momentum_decay", 0.004},
            {"decoupled_weight_decay", false},
            {"maximize", false},
            {"foreach", none},
            {"capturable", false},
            {"differentiable", false}}},
          {"RAdam",
           {{"lr", 0.001},
            {"betas", pair(0.9, 0.999)},
            {"eps", 1e-08},
            {"weight_decay", 0.0},
            {"maximize", false},
            {"foreach", none},
            {"capturable", false},
            {"decoupled_weight_decay", false},
            {"differentiable", false}}},
          {"ASGD",
           {{"lr", 0.01},
            {"lambd", 0.0001},
            {"alpha", 0.75},
            {"t0", 1000000.0},
            {"weight_decay", 0.0},
            {"foreach", none},
            {"maximize", false},
            {"differentiable", false},
            {"capturable", false}}},
          {"Adafactor",
           {{"lr", 0.01},
            {"beta2_decay", -0.8},
            {"eps", pair(none, 0.001)},
            {"d", 1.0},
            {"weight_decay", 0.0},
            {"foreach", none},
            {"maximize", false}}},
          {"SparseAdam",
           {{"lr", 0.001}, {"betas", pair(0.9, 0.999)}, {"eps", 1e-08}, {"maximize", false}}},
          {"Muon",
           {{"lr", 0.001},
            {"weight_decay", 0.1},
            {"momentum", 0.95},
            {"nesterov", true},
            {"ns_coefficients", c10::ivalue::Tuple::create({3.4445, -4.775, 2.0315})},
            {"eps", 1e-07},
            {"ns_steps", int64_t{5}},
            {"adjust_lr_fn", none}}},
      };
  for (const auto& [name, want] : groups) {
    SCOPED_TRACE(name);
    auto opt = FunctionalRegistry::global().create(name, {at::zeros({2, 2})}, new_options_dict());
    const OptionsDict got = opt->options_dict();
    ASSERT_EQ(got.size(), want.size());
    size_t k = 0;
    for (const auto& kv : got) {
      EXPECT_EQ(kv.key().toStringRef(), want[k].first) << "key " << k;
      EXPECT_EQ(kv.value(), want[k].second) << kv.key().toStringRef();
      ++k;
    }
    opt->set_options(got);  // and the dict is accepted back as it is
  }
}

// Adafactor's eps1=None (the dtype's machine epsilon) survives the options dict both ways, and a
// state dict whose state does not fit a parameter's dimensions is refused before anything changes.
TEST(FunctionalOptimizersTest, AdafactorEpsNoneAndStateOfTheWrongKind) {
  std::vector<at::Tensor> params = {at::ones({2, 3}), at::ones({4})};
  FunctionalAdafactor adafactor(params, AdafactorOptions().eps({1e-4, 1e-3}));
  OptionsDict eps_none = new_options_dict();
  eps_none.insert("eps", c10::ivalue::Tuple::create({c10::IValue(), 2e-3}));
  adafactor.set_options(eps_none);
  EXPECT_FALSE(std::get<0>(adafactor.options().eps()).has_value());
  EXPECT_EQ(std::get<1>(adafactor.options().eps()), 2e-3);
  adafactor.step({at::ones({2, 3}), at::ones({4})});
  auto state = adafactor.state_dict().toGenericDict().at("state").toGenericDict();
  EXPECT_EQ(state.at(0).toGenericDict().at("row_var").toTensor().sizes(),
            (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(state.at(0).toGenericDict().at("col_var").toTensor().sizes(),
            (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(state.at(1).toGenericDict().at("variance").toTensor().sizes(),
            (std::vector<int64_t>{4}));

  c10::IValue swapped = adafactor.state_dict();  // the vector's variance given to the matrix
  auto swapped_state = swapped.toGenericDict().at("state").toGenericDict();
  auto entry = swapped_state.at(0).toGenericDict();
  (void)entry.erase("row_var");
  (void)entry.erase("col_var");
  entry.insert("variance", at::zeros({2, 3}));
  FunctionalAdafactor other({at::ones({2, 3}), at::ones({4})}, AdafactorOptions());
  other.load_state_dict(swapped);
  const at::Tensor before = other.params()[1].clone();
  expect_error(
      [&] {
        other.step({at::ones({2, 3}), at::ones({4})});
      },
      "Adafactor: parameter 0 has 2 dimensions, so its state needs 'row_var' and 'col_var'");
  EXPECT_TRUE(other.params()[1].equal(before));
}

// SparseAdam takes sparse COO gradients only, and refuses a dense one with PyTorch's message;
// the other optimizers refuse sparse ones.
TEST(FunctionalOptimizersTest, SparseGradientsAreSparseAdamsOnly) {
  at::Tensor w = at::ones({4, 2});
  FunctionalSparseAdam sparse_adam({w}, SparseAdamOptions().lr(0.1));
  expect_error(
      [&] {
        sparse_adam.step({at::ones({4, 2})});
      },
      "SparseAdam does not support dense gradients, please consider Adam instead (gradient 0 is "
      "dense;");
  EXPECT_FALSE(sparse_adam.has_state(0));
  // Rows 1 and 3 only: the others and their state keep their values.
  at::Tensor grad = at::zeros({4, 2});
  grad.select(0, 1).fill_(1.0);
  grad.select(0, 3).fill_(-2.0);
  sparse_adam.step({grad.to_sparse(1)});
  EXPECT_TRUE(w.select(0, 0).equal(at::ones({2})));
  EXPECT_TRUE(w.select(0, 2).equal(at::ones({2})));
  EXPECT_FALSE(w.select(0, 1).equal(at::ones({2})));
  auto entry =
      sparse_adam.state_dict().toGenericDict().at("state").toGenericDict().at(0).toGenericDict();
  EXPECT_TRUE(entry.at("step").isInt());
  EXPECT_TRUE(entry.at("exp_avg").toTensor().select(0, 0).equal(at::zeros({2})));
  // A gradient without values counts a step and changes nothing else (PyTorch's quirk).
  const at::Tensor after = w.clone();
  sparse_adam.step({at::zeros({4, 2}).to_sparse(1)});
  EXPECT_TRUE(w.equal(after));
  entry =
      sparse_adam.state_dict().toGenericDict().at("state").toGenericDict().at(0).toGenericDict();
  EXPECT_EQ(entry.at("step").toInt(), 2);

  FunctionalAdam adam({at::ones({4, 2})}, AdamOptions());
  expect_error([&] { adam.step({grad.to_sparse(1)}); },
               "Adam: gradient 0 is sparse; this optimizer does not support");
}

// Muon updates 2-D parameters only and says so at construction, as PyTorch does.
TEST(FunctionalOptimizersTest, MuonRefusesParametersThatAreNotMatrices) {
  expect_error(
      [] {
        FunctionalMuon({at::zeros({3, 4}), at::zeros({5})}, MuonOptions());
      },
      "Muon only supports 2D parameters whereas we found a parameter with size: torch.Size([5])");
  expect_error(
      [] {
        FunctionalMuon({at::zeros({2, 3, 4})}, MuonOptions());
      },
      "torch.Size([2, 3, 4])");
  OptionsDict o = new_options_dict();
  expect_error([&] { FunctionalRegistry::global().create("Muon", {at::zeros({})}, o); },
               "torch.Size([])");
  std::vector<at::Tensor> tall = {
      at::eye(5).narrow(1, 0, 3).clone()};  // 5 x 3: orthogonalised transposed
  FunctionalMuon muon(tall, MuonOptions().lr(0.1).weight_decay(0));
  muon.step({at::ones({5, 3})});
  EXPECT_EQ(tall[0].sizes(), (std::vector<int64_t>{5, 3}));
  EXPECT_FALSE(
      muon.state_dict().toGenericDict().at("state").toGenericDict().at(0).toGenericDict().contains(
          "step"));
}

// PyTorch 2.7+: Adam(decoupled_weight_decay=True) is AdamW, and both param groups say which they
// are; built against 2.6 (no such option there) Adam refuses it and neither group has the key.
TEST(FunctionalOptimizersTest, AdamDecoupledWeightDecayIsAdamW) {
  std::vector<at::Tensor> a = {at::linspace(-1, 1, 7)}, b = {a[0].clone()}, c = {a[0].clone()};
  const AdamOptions decoupled =
      AdamOptions().lr(0.1).weight_decay(0.5).decoupled_weight_decay(true);
  FunctionalAdamW adamw(b, AdamWOptions().lr(0.1).weight_decay(0.5));
  FunctionalAdam l2(c, AdamOptions().lr(0.1).weight_decay(0.5));
  if (!kAdamHasDecoupledWeightDecay) {
    expect_error([&] { FunctionalAdam(a, decoupled); },
                 "decoupled_weight_decay=True needs LibTorch 2.7");
    EXPECT_FALSE(l2.options_dict().contains("decoupled_weight_decay"));
    EXPECT_FALSE(adamw.options_dict().contains("decoupled_weight_decay"));
    return;
  }
  FunctionalAdam adam(a, decoupled);
  for (int i = 0; i < 3; ++i) {
    const std::vector<at::Tensor> g = {at::cos(at::arange(7.0) * (i + 1))};
    adam.step(g);
    adamw.step(g);
    l2.step(g);
  }
  EXPECT_TRUE(a[0].equal(b[0]));
  EXPECT_FALSE(a[0].equal(c[0]));
  EXPECT_TRUE(adam.options_dict().at("decoupled_weight_decay").toBool());
  EXPECT_FALSE(l2.options_dict().at("decoupled_weight_decay").toBool());
  EXPECT_TRUE(adamw.options_dict().at("decoupled_weight_decay").toBool());
  // Through the registry and a loaded state dict, as PyTorch writes them.
  OptionsDict on = new_options_dict();
  on.insert("decoupled_weight_decay", true);
  auto made = FunctionalRegistry::global().create("Adam", {at::zeros({2})}, on);
  EXPECT_TRUE(made->options_dict().at("decoupled_weight_decay").toBool());
  l2.load_state_dict(adam.state_dict());
  EXPECT_TRUE(l2.options_dict().at("decoupled_weight_decay").toBool());
}

}  // namespace
}  // namespace dtrain::optim
