// Parity of every built-in functional optimizer with PyTorch: the trajectories and final state
// PyTorch wrote (optim/functional/testdata/make_reference.py: the checked-in files from PyTorch 2.14, or with
// DTRAIN_REFERENCE_DIR set -- optimizers_installed_pytorch_test -- the ones the installed
// PyTorch wrote at build time), on the fused and the ATen path, float32 and float64; and LibTorch's
// own torch::optim where it has the optimizer. One test per (check, reference file).
#include "optim/functional/optimizers.h"

#include <cstdlib>
#include <fstream>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "optim/functional/registry.h"
#include "optim/functional/testing/reference.h"

namespace dtrain::optim {
namespace {

using testing::Layout;
using testing::make_param;
using testing::read_reference;
using testing::ReferenceCase;
using testing::relative_error;

#define DTRAIN_REFERENCE_NAME(name) name,
const char* const kFiles[] = {DTRAIN_BUILTIN_REFERENCES(DTRAIN_REFERENCE_NAME)};  // builtin.bzl
#undef DTRAIN_REFERENCE_NAME

const char* installed_reference_dir() {
  const char* dir = std::getenv("DTRAIN_REFERENCE_DIR");
  return dir != nullptr && *dir != '\0' ? dir : nullptr;
}

// The checked-in trajectories (optim/functional/testdata/), or the installed PyTorch's (see the top).
std::string reference_path(const std::string& name) {
  const char* dir = installed_reference_dir();
  return std::string(dir != nullptr ? dir : "optim/functional/testdata/") + name + ".ref";
}

std::string registry_name(const std::string& case_name) {
  return case_name.substr(0, case_name.rfind('_'));
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
    for (size_t i = 0; i < params.size(); ++i) grads.push_back(c.grad(step, i, dtype));
    opt->step(grads);
    const auto& want = dtype == at::kDouble ? c.params64[step] : c.params32[step];
    for (size_t i = 0; i < params.size(); ++i)
      worst = std::max(worst, relative_error(params[i], want[i]));
  }
  if (out) *out = std::move(opt);
  return worst;
}

// One reference file's cases. The checked-in files must all be there; in the installed PyTorch's
// directory a file is absent (an empty placeholder: Bazel needs every declared output) when that
// PyTorch lacks the optimizer (Muon before PyTorch 2.9), and its tests are skipped.
class ReferenceTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    const std::string path = reference_path(GetParam());
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (installed_reference_dir() != nullptr && (!in || in.tellg() == 0)) {
      GTEST_SKIP()
          << path << " is absent: the installed PyTorch does not have this optimizer, so "
          << "make_reference.py wrote no trajectory for it (the checked-in one is still tested)";
    }
    cases_ = read_reference(path);
    ASSERT_FALSE(cases_.empty()) << path;
  }
  std::vector<ReferenceCase> cases_;
};

TEST_P(ReferenceTest, MatchPyTorchFloat32) {
  for (const ReferenceCase& c : cases_) {
    SCOPED_TRACE(c.name);
    EXPECT_LE(run_case(c, at::kFloat, Layout::kContiguous), 1e-6) << "fused float32 path";
    EXPECT_LE(run_case(c, at::kFloat, Layout::kStrided), 1e-6) << "ATen float32 path";
  }
}

TEST_P(ReferenceTest, MatchPyTorchFloat64) {
  for (const ReferenceCase& c : cases_) {
    SCOPED_TRACE(c.name);
    EXPECT_LE(run_case(c, at::kDouble, Layout::kContiguous), 1e-12) << "fused float64 path";
    EXPECT_LE(run_case(c, at::kDouble, Layout::kStrided), 1e-12) << "ATen float64 path";
  }
}

// Keys, values and types of the state dict equal PyTorch's state: "step" a float32 tensor where
// PyTorch 2.x keeps one (an int for SparseAdam), NAdam's mu_product and ASGD's eta and mu float32
// scalars also for float64 parameters.
void expect_state_matches_pytorch(const ReferenceCase& c, Layout layout) {
  std::unique_ptr<FunctionalOptimizer> opt;
  run_case(c, at::kDouble, layout, &opt);
  auto sd = opt->state_dict().toGenericDict();
  auto state = sd.at("state").toGenericDict();
  size_t entries = 0;
  for (const auto& kv : state) entries += kv.value().toGenericDict().size();
  // A None entry (1.13's SGD momentum_buffer, in references PyTorch 1.13 wrote) is absent from
  // state dicts, as in PyTorch 2.x.
  auto absent = [](const at::Tensor& want) { return !want.defined(); };
  size_t expected = 0;
  for (const auto& entry : c.final_state) expected += absent(entry.value) ? 0 : 1;
  EXPECT_EQ(entries, expected) << "number of (param, key) state entries";
  for (const testing::StateValue& want : c.final_state) {
    if (absent(want.value)) continue;
    const auto param = static_cast<int64_t>(want.param);
    ASSERT_TRUE(state.contains(param)) << "param " << param;
    auto entry = state.at(param).toGenericDict();
    ASSERT_TRUE(entry.contains(want.key)) << "param " << param << " key " << want.key;
    const c10::IValue v = entry.at(want.key);
    if (want.kind == "int") {
      ASSERT_TRUE(v.isInt()) << "param " << param << " " << want.key
                             << ": PyTorch keeps a Python int, dtrain " << v.tagKind();
    } else if (!want.kind.empty()) {
      ASSERT_TRUE(v.isTensor()) << "param " << param << " " << want.key << ": PyTorch keeps a "
                                << want.kind << " tensor, dtrain " << v.tagKind();
      const std::string dtype = c10::toString(v.toTensor().scalar_type());
      EXPECT_EQ(dtype, want.kind == "float32"   ? "Float"
                       : want.kind == "float64" ? "Double"
                                                : want.kind)
          << "param " << param << " " << want.key;
    }
    const at::Tensor got =
        v.isTensor() ? v.toTensor() : at::scalar_tensor(static_cast<double>(v.toInt()));
    if (want.key == "step") {
      EXPECT_EQ(got.item<double>(), want.value.item<double>()) << "param " << param;
    } else {
      EXPECT_LE(relative_error(got.reshape(-1), want.value), 1e-12)
          << "param " << param << " " << want.key;
    }
  }
  // The param group carries PyTorch's keys and the parameter indices.
  auto group = sd.at("param_groups").toList().get(0).toGenericDict();
  EXPECT_TRUE(group.contains("lr"));
  EXPECT_EQ(group.at("params").toList().size(), 3u);
}

TEST_P(ReferenceTest, StateDictMatchesPyTorchState) {
  for (const ReferenceCase& c : cases_) {
    for (Layout layout : {Layout::kContiguous, Layout::kStrided}) {
      SCOPED_TRACE(c.name + (layout == Layout::kContiguous ? " (fused path)" : " (ATen path)"));
      expect_state_matches_pytorch(c, layout);
    }
  }
}

// Run 20 steps, save, load into a fresh optimizer on copies of the parameters, then both run to
// 50 steps: the trajectories must stay identical. (float32: PyTorch's load_state_dict casts
// NAdam's and ASGD's float32 scalar state to the parameters' dtype, and so does dtrain, so a
// float64 run would continue with more precise scalars than the uninterrupted one.)
TEST_P(ReferenceTest, StateDictRoundTripContinuesTheTrajectory) {
  const ReferenceCase& c = cases_.back();
  SCOPED_TRACE(c.name);
  std::vector<at::Tensor> a;
  for (const auto& t : c.init) a.push_back(t.to(at::kFloat));
  auto opt_a = FunctionalRegistry::global().create(registry_name(c.name), a, c.options);
  auto grads_at = [&](int step) {
    std::vector<at::Tensor> g;
    for (size_t i = 0; i < a.size(); ++i) g.push_back(c.grad(step, i, at::kFloat));
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

INSTANTIATE_TEST_SUITE_P(Optimizers, ReferenceTest, ::testing::ValuesIn(kFiles),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

// LibTorch's own torch::optim, stepped on the same inputs, where it has the optimizer and the
// options (LibTorch 1.13 has no `maximize`).
TEST(FunctionalOptimizersTest, MatchLibTorchOptim) {
  struct Pair {
    const char* file;
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>,
                                                           const OptionsDict&)>
        make;
  };
  auto d = [](const OptionsDict& o, const char* k, double def) {
    return o.contains(k) ? o.at(k).toDouble() : def;
  };
  auto flag = [](const OptionsDict& o, const char* k) { return o.contains(k) && o.at(k).toBool(); };
  auto betas = [](const OptionsDict& o, std::tuple<double, double> def) {
    if (!o.contains("betas")) return def;
    auto e = o.at("betas").toTupleRef().elements();
    return std::make_tuple(e[0].toDouble(), e[1].toDouble());
  };
  std::vector<Pair> pairs = {
      {"sgd",
       [&](auto p, const OptionsDict& o) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(d(o, "lr", 0))
                                                           .momentum(d(o, "momentum", 0))
                                                           .dampening(d(o, "dampening", 0))
                                                           .weight_decay(d(o, "weight_decay", 0))
                                                           .nesterov(flag(o, "nesterov")));
       }},
      {"adam",
       [&](auto p, const OptionsDict& o) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(d(o, "lr", 1e-3))
                                                            .betas(betas(o, {0.9, 0.999}))
                                                            .eps(d(o, "eps", 1e-8))
                                                            .weight_decay(d(o, "weight_decay", 0))
                                                            .amsgrad(flag(o, "amsgrad")));
       }},
      {"adamw",
       [&](auto p, const OptionsDict& o) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::AdamW>(p,
                                                      torch::optim::AdamWOptions(d(o, "lr", 1e-3))
                                                          .betas(betas(o, {0.9, 0.999}))
                                                          .eps(d(o, "eps", 1e-8))
                                                          .weight_decay(d(o, "weight_decay", 1e-2))
                                                          .amsgrad(flag(o, "amsgrad")));
       }},
      {"adagrad",
       [&](auto p, const OptionsDict& o) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::Adagrad>(
             p, torch::optim::AdagradOptions(d(o, "lr", 1e-2))
                    .lr_decay(d(o, "lr_decay", 0))
                    .weight_decay(d(o, "weight_decay", 0))
                    .initial_accumulator_value(d(o, "initial_accumulator_value", 0))
                    .eps(d(o, "eps", 1e-10)));
       }},
      {"rmsprop",
       [&](auto p, const OptionsDict& o) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::RMSprop>(
             p, torch::optim::RMSpropOptions(d(o, "lr", 1e-2))
                    .alpha(d(o, "alpha", 0.99))
                    .eps(d(o, "eps", 1e-8))
                    .weight_decay(d(o, "weight_decay", 0))
                    .momentum(d(o, "momentum", 0))
                    .centered(flag(o, "centered")));
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
        for (size_t i = 0; i < ours.size(); ++i)
          worst = std::max(worst, relative_error(ours[i], theirs[i].detach()));
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
      for (size_t i = 0; i < params.size(); ++i)
        grads.push_back(c.grads[step][i].to(at::kFloat) * (1.0 + 0.1 * i));
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
    for (size_t i = 0; i < serial[k].size(); ++i)
      EXPECT_TRUE(serial[k][i].equal(parallel[k][i])) << k << "," << i;
}

}  // namespace
}  // namespace dtrain::optim
