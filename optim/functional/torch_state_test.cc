#include "optim/functional/torch_state.h"

#include <cmath>
#include <typeindex>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "optim/functional/libtorch_compat.h"
#include "optim/functional/optimizers.h"
#include "optim/functional/registry.h"
#include "optim/functional/torch_twins.h"

namespace dtrain::optim {
namespace {

std::vector<at::Tensor> grads_for(int step, const std::vector<at::Tensor>& like) {
  std::vector<at::Tensor> g;
  at::manual_seed(100 + step);
  for (const auto& p : like) g.push_back(at::randn(p.sizes()));
  return g;
}

// Trains `steps` steps of LibTorch's optimizer, moves its state into the functional twin, then
// both continue on copies: trajectories must agree. And back the other way.
template <typename TorchOpt, typename TorchOptions>
void round_trip(const char* name, TorchOptions options) {
  SCOPED_TRACE(name);
  at::manual_seed(0);
  std::vector<at::Tensor> a = {at::randn({3, 4}).requires_grad_(), at::randn({5}).requires_grad_()};
  TorchOpt torch_opt(a, options);
  for (int s = 0; s < 10; ++s) {
    auto g = grads_for(s, a);
    for (size_t i = 0; i < a.size(); ++i) a[i].mutable_grad() = g[i];
    torch_opt.step();
  }
  std::vector<at::Tensor> b;
  for (const auto& p : a) b.push_back(p.detach().clone());
  auto functional = FunctionalRegistry::global().create(name, b, options_from_torch(options));
  functional->load_state_dict(torch_optim_state_dict(torch_opt));
  for (int s = 10; s < 20; ++s) {
    auto g = grads_for(s, a);
    for (size_t i = 0; i < a.size(); ++i) a[i].mutable_grad() = g[i];
    torch_opt.step();
    functional->step(g);
  }
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(a[i].detach().allclose(b[i], 1e-5, 1e-6)) << "torch -> functional " << i;
  // LibTorch's state, as a PyTorch state dict, has the functional optimizer's keys and types:
  // "step" a 0-dim float32 tensor (PyTorch 2.x's; RMSprop's was an int).
  auto entry = [](const c10::IValue& sd) {
    return sd.toGenericDict().at("state").toGenericDict().at(0).toGenericDict();
  };
  const auto theirs = entry(torch_optim_state_dict(torch_opt));
  const auto ours = entry(functional->state_dict());
  EXPECT_EQ(theirs.size(), ours.size());
  for (const auto& kv : ours) {
    const std::string& key = kv.key().toStringRef();
    ASSERT_TRUE(theirs.contains(key)) << key;
    EXPECT_EQ(theirs.at(key).tagKind(), kv.value().tagKind()) << key;
    if (kv.value().isTensor()) {
      EXPECT_EQ(theirs.at(key).toTensor().scalar_type(), kv.value().toTensor().scalar_type())
          << key;
      EXPECT_EQ(theirs.at(key).toTensor().sizes(), kv.value().toTensor().sizes()) << key;
    }
  }

  // functional -> torch: a fresh LibTorch optimizer continues from the functional state.
  std::vector<at::Tensor> c;
  for (const auto& p : b) c.push_back(p.clone().requires_grad_());
  TorchOpt fresh(c, options);
  load_torch_optim_state_dict(fresh, functional->state_dict());
  for (int s = 20; s < 30; ++s) {
    auto g = grads_for(s, b);
    for (size_t i = 0; i < c.size(); ++i) c[i].mutable_grad() = g[i];
    fresh.step();
    functional->step(g);
  }
  for (size_t i = 0; i < c.size(); ++i)
    EXPECT_TRUE(c[i].detach().allclose(b[i], 1e-5, 1e-6)) << "functional -> torch " << i;
}

TEST(TorchStateTest, RoundTripsWithEveryLibTorchTwin) {
  round_trip<torch::optim::SGD>("SGD", torch::optim::SGDOptions(0.1).momentum(0.9));
  round_trip<torch::optim::Adam>("Adam", torch::optim::AdamOptions(0.01).amsgrad(true));
  round_trip<torch::optim::AdamW>("AdamW", torch::optim::AdamWOptions(0.01));
  round_trip<torch::optim::Adagrad>("Adagrad", torch::optim::AdagradOptions(0.1).lr_decay(0.01));
  round_trip<torch::optim::RMSprop>(
      "RMSprop", torch::optim::RMSpropOptions(0.01).centered(true).momentum(0.5));
}

// torch_twins.h's table makes each LibTorch twin with PyTorch's defaults and the options given.
TEST(TorchTwinsTest, MakeBuildsTheLibTorchOptimizerWithTheOptionsGiven) {
  std::vector<at::Tensor> params = {at::zeros({3})};
  const TorchTwin* sgd = twin_named("SGD");
  ASSERT_NE(sgd, nullptr);
  OptionsDict options = new_options_dict();
  options.insert("momentum", 0.9);
  auto opt = sgd->make(params, options);
  auto* typed = dynamic_cast<torch::optim::SGD*>(opt.get());
  ASSERT_NE(typed, nullptr);
  const auto& o = static_cast<const torch::optim::SGDOptions&>(typed->defaults());
  EXPECT_EQ(o.lr(), 1e-3);
  EXPECT_EQ(o.momentum(), 0.9);
  for (const char* name : {"Adam", "AdamW", "Adagrad", "RMSprop"}) {
    const TorchTwin* twin = twin_named(name);
    ASSERT_NE(twin, nullptr) << name;
    auto made = twin->make(params, new_options_dict());
    EXPECT_EQ(std::type_index(typeid(*made)), twin->optimizer) << name;
  }
  EXPECT_EQ(twin_named("Adadelta"), nullptr);  // no LibTorch twin
}

TEST(TorchStateTest, MismatchedGroupsAreAnError) {
  std::vector<at::Tensor> p = {at::zeros({2}).requires_grad_()};
  torch::optim::Adam adam(p, torch::optim::AdamOptions());
  FunctionalAdam functional({at::zeros({2}), at::zeros({1})}, AdamOptions());
  try {
    load_torch_optim_state_dict(adam, functional.state_dict());
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                ::testing::HasSubstr("group 0 has 2 parameters in the state dict and 1"));
  }
}

// A param group whose math LibTorch's optimizer cannot follow (maximize=True; AdamW's decoupled
// weight decay given to Adam) is refused, naming the key, and the optimizer keeps its options and
// state: nothing is applied before everything is checked.
TEST(TorchStateTest, LoadRefusesMathLibTorchCannotRun) {
  std::vector<at::Tensor> p = {at::ones({2}).requires_grad_()};
  torch::optim::Adam adam(p, torch::optim::AdamOptions(0.5));
  p[0].mutable_grad() = at::ones({2});
  adam.step();
  auto lr_of = [&] {
    return static_cast<const torch::optim::AdamOptions&>(adam.param_groups()[0].options()).lr();
  };
  auto expect_refused = [&](const c10::IValue& sd, const std::string& what) {
    try {
      load_torch_optim_state_dict(adam, sd);
      ADD_FAILURE() << "accepted " << what;
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr(what));
    }
    EXPECT_EQ(lr_of(), 0.5);
    EXPECT_EQ(adam.state().size(), 1u);
  };
  OptionsDict maximize = new_options_dict();
  maximize.insert("lr", 0.1);
  maximize.insert("maximize", true);
  FunctionalAdam up({at::ones({2})}, AdamOptions());
  up.set_options(maximize);
  expect_refused(up.state_dict(), "maximize=True, which torch::optim::Adam cannot run");
  if constexpr (kAdamHasDecoupledWeightDecay) {
    FunctionalAdamW adamw({at::ones({2})}, AdamWOptions().lr(0.1));
    expect_refused(adamw.state_dict(),
                   "decoupled_weight_decay=True, which torch::optim::Adam cannot run");
  }
  // The same dicts with the value LibTorch has load.
  maximize.insert_or_assign("maximize", false);
  up.set_options(maximize);
  load_torch_optim_state_dict(adam, up.state_dict());
  EXPECT_EQ(lr_of(), 0.1);
}

// A "step" that is no step count is refused, naming the parameter, whatever its form.
TEST(TorchStateTest, LoadRefusesABadStep) {
  std::vector<at::Tensor> p = {at::ones({2}).requires_grad_()};
  torch::optim::Adam adam(p, torch::optim::AdamOptions());
  p[0].mutable_grad() = at::ones({2});
  adam.step();
  const c10::IValue good = torch_optim_state_dict(adam);
  const std::vector<std::pair<c10::IValue, std::string>> bad = {
      {at::scalar_tensor(std::nan(""), at::kFloat), "is nan"},
      {at::scalar_tensor(-3.0, at::kFloat), "is -3"},
      {at::scalar_tensor(1.5, at::kFloat), "is 1.5"},
      {1e300, "is 1e+300"},
      {int64_t{-1}, "is -1"},
      {at::zeros({2}), "is not a number (a tensor of shape [2])"},
      {c10::IValue("7"), "is not a number (String)"},
  };
  for (const auto& [step, what] : bad) {
    SCOPED_TRACE(what);
    c10::IValue sd = good.deepcopy();
    sd.toGenericDict().at("state").toGenericDict().at(0).toGenericDict().insert_or_assign("step",
                                                                                          step);
    try {
      load_torch_optim_state_dict(adam, sd);
      ADD_FAILURE() << "accepted";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  ::testing::HasSubstr("state 'step' of parameter 0 " + what));
    }
  }
  load_torch_optim_state_dict(adam, good);
}

}  // namespace
}  // namespace dtrain::optim
