// The built-in functional optimizers' state dicts and option dicts against PyTorch's: step types,
// dtype casts on load, param-group keys, state of the wrong kind, sparse gradients, Muon's
// matrices, Adam's decoupled weight decay.
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

using test_util::expect_error;
using ::testing::HasSubstr;
using testing::Layout;
using testing::make_param;
using testing::options_dict;
using testing::relative_error;

// PyTorch 2.x keeps "step" as a 0-dim float32 tensor for every optimizer that counts steps but
// SparseAdam (a Python int); dtrain's state dicts hold the same types (RMSprop, Adadelta and Rprop
// used to hold an int, PyTorch 1.13's format).
TEST(FunctionalOptimizersTest, StepIsAFloat32TensorAsInPyTorch2) {
  for (const char* name : {"Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop", "Rprop",
                           "NAdam", "RAdam", "ASGD", "Adafactor"}) {
    SCOPED_TRACE(name);
    std::vector<at::Tensor> params = {at::zeros({3})};
    auto opt = FunctionalRegistry::global().create(name, params, options_dict({{"lr", 0.1}}));
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
  // Refused when loaded (the update would need row_var and col_var), leaving no state behind.
  expect_error([&] { other.load_state_dict(swapped); },
               "Adafactor.load_state_dict: parameter 0 has state but no 'row_var'");
  EXPECT_FALSE(other.has_state(0));
  EXPECT_FALSE(other.has_state(1));
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

// PyTorch's load replaces the whole param group: an option the loaded group lacks takes the value
// PyTorch's __setstate__ gives it -- not the loading optimizer's -- and a group without an option
// PyTorch has no default for (its next step would raise KeyError) is refused, naming the key.
TEST(FunctionalOptimizersTest, AGroupWithoutAnOptionTakesPyTorchsLoadDefault) {
  auto group_of = [](const c10::IValue& sd) {
    return sd.toGenericDict().at("param_groups").toList().get(0).toGenericDict();
  };
  auto without = [&](const FunctionalOptimizer& source, std::vector<std::string> keys) {
    c10::IValue sd = source.state_dict().deepcopy();
    for (const std::string& k : keys) (void)group_of(sd).erase(k);
    return sd;
  };
  std::vector<at::Tensor> params = {at::zeros({3})};
  FunctionalSGD plain(params, SGDOptions(0.1).momentum(0.9));
  plain.step({at::ones({3})});
  FunctionalSGD nesterov({at::zeros({3})}, SGDOptions(0.5).momentum(0.5).nesterov(true));
  nesterov.load_state_dict(without(plain, {"nesterov"}));
  EXPECT_FALSE(group_of(nesterov.state_dict()).at("nesterov").toBool());  // PyTorch's default
  EXPECT_EQ(group_of(nesterov.state_dict()).at("lr").toDouble(), 0.1);    // the file's

  FunctionalRMSprop rms_source({at::zeros({3})}, RMSpropOptions().lr(0.1));
  rms_source.step({at::ones({3})});
  FunctionalRMSprop centered({at::zeros({3})},
                             RMSpropOptions().lr(0.1).momentum(0.5).centered(true));
  centered.load_state_dict(without(rms_source, {"momentum", "centered", "foreach"}));
  EXPECT_EQ(group_of(centered.state_dict()).at("momentum").toDouble(), 0.0);
  EXPECT_FALSE(group_of(centered.state_dict()).at("centered").toBool());
  centered.step({at::ones({3})});  // steps without the buffers it no longer needs

  for (const char* key : {"lr", "momentum", "dampening", "weight_decay"}) {
    SCOPED_TRACE(key);
    FunctionalSGD target({at::zeros({3})}, SGDOptions(0.1).momentum(0.9));
    expect_error([&] { target.load_state_dict(without(plain, {key})); },
                 std::string("SGD.load_state_dict: param_groups[0] has no '") + key + "'");
    EXPECT_EQ(group_of(target.state_dict()).at("lr").toDouble(), 0.1);  // nothing applied
  }
}

}  // namespace
}  // namespace dtrain::optim
