// The built-in functional optimizers' behaviour beyond the PyTorch trajectories
// (optimizers_test.cc has those): errors with PyTorch's messages, state that options need, option
// changes between steps. State dicts: optimizers_state_test.cc; kernels: optimizers_kernels_test.cc.
#include "optim/functional/optimizers.h"

#include <functional>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "optim/functional/internal/fused.h"
#include "optim/functional/libtorch_compat.h"
#include "optim/functional/registry.h"
#include "optim/functional/testing/reference.h"
#include "testing/test_util.h"

namespace dtrain::optim {
namespace {

using ::testing::HasSubstr;
using testing::Layout;
using testing::make_param;
using testing::options_dict;
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

// amsgrad (Adam, AdamW), momentum and centered (RMSprop) switched on after a parameter has state:
// PyTorch raises KeyError for the missing state entry; dtrain raises before changing anything, on
// the fused and the ATen path. SGD's momentum may be switched on later (PyTorch starts the buffer).
TEST(FunctionalOptimizersTest, SwitchingOnStatefulOptionsAfterTheFirstStepIsAnError) {
  const std::vector<std::tuple<const char*, OptionsDict, const char*>> cases = {
      {"Adam", options_dict({{"amsgrad", true}}),
       "Adam: amsgrad=True needs the state 'max_exp_avg_sq', which parameter 0"},
      {"AdamW", options_dict({{"amsgrad", true}}),
       "AdamW: amsgrad=True needs the state 'max_exp_avg_sq', which parameter 0"},
      {"RMSprop", options_dict({{"momentum", 0.9}}),
       "RMSprop: momentum > 0 needs the state 'momentum_buffer'"},
      {"RMSprop", options_dict({{"centered", true}}),
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
      auto opt = FunctionalRegistry::global().create(name, params, options_dict({{"lr", 0.1}}));
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
      {"SGD", options_dict({{"lr", 0.1}, {"momentum", 0.9}, {"dampening", 0.5}}),
       options_dict({{"momentum", 0.0}})},
      {"Adam", options_dict({{"lr", 0.1}, {"amsgrad", true}}), options_dict({{"amsgrad", false}})},
      {"AdamW", options_dict({{"lr", 0.1}, {"amsgrad", true}}), options_dict({{"amsgrad", false}})},
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

}  // namespace
}  // namespace dtrain::optim
