// The fused CPU kernels: the multi-tensor path on large tensors, fused=True through ATen's own
// CPU kernels, and the AVX2 build against the baseline, bit for bit.
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
using testing::relative_error;

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

// fused=True on CPU runs ATen's CPU fused kernels, as PyTorch's fused=True: the parameters equal
// at::_fused_adam_ / _fused_adamw_ / _fused_sgd_ called directly, step for step, bit for bit.
// (Unset, dtrain's own kernel runs: PyTorch's single-tensor numerics, which ATen's fused Adam does
// not reproduce bit for bit: its moving averages are a lerp.)
TEST(FunctionalOptimizersTest, CpuFusedTrueIsAtensFusedKernel) {
  at::manual_seed(5);
  const std::vector<at::Tensor> init = {at::randn({37}), at::randn({100003})};
  for (const std::string name : {"Adam", "AdamW", "SGD"}) {
    SCOPED_TRACE(name);
    std::vector<at::Tensor> ours, ref, m, v, steps;
    for (const auto& t : init) {
      ours.push_back(t.clone());
      ref.push_back(t.clone());
      m.push_back(at::zeros_like(t));
      v.push_back(at::zeros_like(t));
      steps.push_back(at::zeros({}, at::kFloat));
    }
    OptionsDict o = new_options_dict();
    o.insert("lr", 0.01);
    o.insert("weight_decay", 0.1);
    o.insert("fused", true);
    if (name == "SGD") o.insert("momentum", 0.9);
    auto opt = FunctionalRegistry::global().create(name, ours, o);
    for (int s = 0; s < 5; ++s) {
      std::vector<at::Tensor> g;
      for (const auto& t : ref) g.push_back(at::randn_like(t));
      opt->step(g);
      if (name == "SGD") {
        at::_fused_sgd_(ref, g, m, 0.1, 0.9, 0.01, 0, false, false, /*is_first_step=*/s == 0);
        continue;
      }
      at::_foreach_add_(steps, 1);
      if (name == "AdamW") {
        at::_fused_adamw_(ref, g, m, v, {}, steps, 0.01, 0.9, 0.999, 0.1, 1e-8, false, false);
      } else {
        at::_fused_adam_(ref, g, m, v, {}, steps, 0.01, 0.9, 0.999, 0.1, 1e-8, false, false);
      }
    }
    for (size_t i = 0; i < ours.size(); ++i) {
      EXPECT_TRUE(ours[i].equal(ref[i]))
          << "param " << i << " differs by " << (ours[i] - ref[i]).abs().max();
    }
  }
}

void expect_build_matches_baseline(internal::KernelIsa isa, const char* name,
                                   const std::vector<std::pair<const char*, c10::IValue>>& options);

// The AVX2 build of the fused kernels (used on CPUs that have AVX2) and the baseline build give
// bit-identical parameters and state for every optimizer and option, float and double, with sizes
// that leave vector remainders.
TEST(FunctionalOptimizersTest, Avx2KernelsAreBitIdenticalToTheBaseline) {
  if (internal::cpu_kernel_isa() == internal::KernelIsa::kBaseline)
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
  for (const Config& c : configs)
    expect_build_matches_baseline(internal::KernelIsa::kAvx2, c.name, c.options);
}

// The check above, for one optimizer: `isa`'s build against the baseline, 8 steps.
void expect_build_matches_baseline(
    internal::KernelIsa isa, const char* name,
    const std::vector<std::pair<const char*, c10::IValue>>& options) {
  {
    for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
      std::vector<std::vector<at::Tensor>> params(2);
      at::manual_seed(11);
      for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{37}, int64_t{100003}}) {
        at::Tensor t = at::randn({n}, dtype);
        params[0].push_back(t.clone());
        params[1].push_back(t.clone());
      }
      OptionsDict o = new_options_dict();
      for (const auto& [k, v] : options) o.insert(k, v);
      auto wide = FunctionalRegistry::global().create(name, params[0], o);
      auto base = FunctionalRegistry::global().create(name, params[1], o);
      for (int s = 0; s < 8; ++s) {
        std::vector<at::Tensor> g;
        for (const auto& p : params[0]) g.push_back(at::randn_like(p));
        internal::kernel_isa_cap() = isa;
        wide->step(g);
        internal::kernel_isa_cap() = internal::KernelIsa::kBaseline;
        base->step(g);
        internal::kernel_isa_cap() = internal::KernelIsa::kAvx512;
      }
      for (size_t i = 0; i < params[0].size(); ++i) {
        EXPECT_TRUE(params[0][i].equal(params[1][i]))
            << name << " " << c10::toString(dtype) << " param " << i << " differs by "
            << (params[0][i] - params[1][i]).abs().max();
      }
    }
  }
}

}  // namespace
}  // namespace dtrain::optim
