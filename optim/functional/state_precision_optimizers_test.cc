// Every built-in optimizer with its state in bfloat16 (and Adam/AdamW in 8 bits): trajectories
// near float32's, bit-for-bit resume, the fused low-precision kernels equal to the float path,
// state dicts and their checks, and why stochastic rounding is the default.
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "optim/functional/internal/fused.h"
#include "optim/functional/internal/low_precision.h"
#include "optim/functional/optimizers.h"
#include "optim/functional/registry.h"
#include "optim/functional/state_precision.h"
#include "optim/functional/testing/reference.h"
#include "testing/test_util.h"

namespace dtrain::optim {
namespace {

using test_util::expect_error;

// The dense built-ins (SparseAdam takes sparse gradients: its own test below).
const std::vector<std::string>& dense_names() {
  static const std::vector<std::string> names = {
      "SGD",   "Adam",  "AdamW", "Adagrad", "Adadelta",  "Adamax", "RMSprop",
      "Rprop", "NAdam", "RAdam", "ASGD",    "Adafactor", "Muon"};
  return names;
}

bool has_8bit(const std::string& name) { return name == "Adam" || name == "AdamW"; }

// Options that give every optimizer state to keep: SGD with momentum, RMSprop centered.
OptionsDict options_for(const std::string& name, const char* state_dtype, bool stochastic = true) {
  OptionsDict o = new_options_dict();
  o.insert("lr", name == "Adadelta" ? 1.0 : 0.01);
  if (name == "SGD") o.insert("momentum", 0.9);
  if (name == "RMSprop") {
    o.insert("momentum", 0.9);
    o.insert("centered", true);
  }
  if (state_dtype != nullptr) o.insert(kStateDtypeKey, std::string(state_dtype));
  o.insert(kStateStochasticRoundingKey, stochastic);
  o.insert(kStateSeedKey, int64_t{7});
  return o;
}

std::vector<at::Tensor> make_params(const std::string& name) {
  at::manual_seed(1);
  if (name == "Muon") return {at::randn({24, 40}), at::randn({300, 3})};
  return {at::randn({24, 40}), at::randn({700}), at::randn({1})};
}

// Gradient of 0.5 * |p - target|^2 plus noise fixed by (step, parameter).
std::vector<at::Tensor> grads_for(const std::vector<at::Tensor>& params, int step) {
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    at::manual_seed(1000 * step + static_cast<int64_t>(i));
    grads.push_back(params[i] - 0.5 + 0.1 * at::randn(params[i].sizes()));
  }
  return grads;
}

std::vector<at::Tensor> clone_all(const std::vector<at::Tensor>& v) {
  std::vector<at::Tensor> out;
  for (const auto& t : v) out.push_back(t.clone());
  return out;
}

struct Trainer {
  std::vector<at::Tensor> params;
  std::unique_ptr<FunctionalOptimizer> opt;
};

Trainer start(const std::string& name, const OptionsDict& options) {
  Trainer r;
  r.params = make_params(name);
  r.opt = FunctionalRegistry::global().create(name, r.params, options);
  return r;
}

void steps(Trainer& r, int from, int to) {
  for (int s = from; s < to; ++s) r.opt->step(grads_for(r.params, s));
}

c10::impl::GenericDict entry(const FunctionalOptimizer& opt, int64_t index) {
  return opt.state_dict().toGenericDict().at("state").toGenericDict().at(index).toGenericDict();
}

int64_t state_bytes(const FunctionalOptimizer& opt) {
  int64_t bytes = 0;
  for (const auto& kv : opt.state_dict().toGenericDict().at("state").toGenericDict()) {
    for (const auto& slot : kv.value().toGenericDict()) {
      if (slot.key().toStringRef() != "step" && slot.value().isTensor()) {
        bytes += slot.value().toTensor().nbytes();
      }
    }
  }
  return bytes;
}

TEST(StatePrecisionOptimizers, BFloat16StateStaysNearFloat32ForEveryOptimizer) {
  for (const std::string& name : dense_names()) {
    SCOPED_TRACE(name);
    Trainer f32 = start(name, options_for(name, nullptr));
    Trainer bf16 = start(name, options_for(name, kStateBFloat16));
    steps(f32, 0, 30);
    steps(bf16, 0, 30);
    for (size_t i = 0; i < f32.params.size(); ++i) {
      // Mean, not max: Rprop's sign-driven steps make a rare element whose gradient is near 0
      // take another path in any two runs that differ at all.
      const double err = (bf16.params[i] - f32.params[i]).abs().mean().item<double>() /
                         f32.params[i].abs().mean().item<double>();
      // The stated tolerances: 1% of the parameters' mean magnitude after 30 steps; centered
      // RMSprop 3% (its denominator is the difference of two bfloat16 moments); Rprop 5% over the
      // multi-element parameters (sign-driven: its single element may take another path).
      if (name == "Rprop" && f32.params[i].numel() == 1) continue;
      const double tolerance = name == "RMSprop" ? 3e-2 : name == "Rprop" ? 5e-2 : 1e-2;
      EXPECT_LT(err, tolerance) << "parameter " << i;
      if (i == 0 && name != "ASGD") {  // ASGD's only elementwise state is the average
        EXPECT_FALSE(at::equal(bf16.params[i], f32.params[i])) << "bfloat16 changed nothing";
      }
    }
    // Every elementwise slot is bfloat16; the state takes about half the bytes.
    for (const auto& kv : entry(*bf16.opt, 0)) {
      const std::string key = kv.key().toStringRef();
      if (!kv.value().isTensor() || key == "step" || kv.value().toTensor().dim() == 0) continue;
      EXPECT_EQ(kv.value().toTensor().scalar_type(), at::kBFloat16) << key;
    }
    EXPECT_LT(state_bytes(*bf16.opt), state_bytes(*f32.opt) * 0.6);
  }
}

TEST(StatePrecisionOptimizers, ResumesBitForBitAtEveryPrecision) {
  for (const std::string& name : dense_names()) {
    for (const char* dtype : {kStateBFloat16, kState8Bit}) {
      if (std::string(dtype) == kState8Bit && !has_8bit(name)) continue;
      SCOPED_TRACE(name + " " + dtype);
      Trainer straight = start(name, options_for(name, dtype));
      steps(straight, 0, 10);
      Trainer first = start(name, options_for(name, dtype));
      steps(first, 0, 5);
      Trainer resumed =
          start(name, options_for(name, nullptr));  // the file's group sets state_dtype
      for (size_t i = 0; i < resumed.params.size(); ++i) resumed.params[i].copy_(first.params[i]);
      resumed.opt->load_state_dict(first.opt->state_dict());
      steps(resumed, 5, 10);
      for (size_t i = 0; i < straight.params.size(); ++i) {
        EXPECT_TRUE(at::equal(straight.params[i], resumed.params[i])) << "parameter " << i;
      }
      for (const auto& kv : entry(*straight.opt, 0)) {
        const c10::IValue other = entry(*resumed.opt, 0).at(kv.key());
        if (kv.value().isTensor()) {
          EXPECT_TRUE(at::equal(kv.value().toTensor(), other.toTensor())) << kv.key().toStringRef();
        }
      }
    }
  }
}

// The fused kernels against the float path (decode, float kernel, encode): the same bits, for
// bfloat16 (stochastic and nearest) and 8-bit, with and without amsgrad, AVX-512 (where the CPU
// has it: otherwise that variant runs the AVX2 build again), AVX2 and baseline builds,
// tensors one block, partial blocks and large enough to be split among threads.
TEST(StatePrecisionOptimizers, AdamKernelsEqualTheFloatPath) {
  struct Case {
    const char* name;
    const char* dtype;
    bool stochastic;
    bool amsgrad;
  };
  for (const Case& c :
       {Case{"Adam", kStateBFloat16, true, false}, Case{"AdamW", kStateBFloat16, false, true},
        Case{"Adam", kState8Bit, true, true}, Case{"AdamW", kState8Bit, true, false}}) {
    SCOPED_TRACE(std::string(c.name) + " " + c.dtype + (c.amsgrad ? " amsgrad" : ""));
    std::vector<std::vector<at::Tensor>> results;
    for (int variant = 0; variant < 4; ++variant) {
      internal::low_precision_kernels_enabled() = variant != 0;
      internal::kernel_isa_cap() = variant == 3   ? internal::KernelIsa::kAvx512
                                   : variant == 2 ? internal::KernelIsa::kBaseline
                                                  : internal::KernelIsa::kAvx2;
      at::manual_seed(2);
      std::vector<at::Tensor> params = {at::randn({256}), at::randn({5, 77}), at::randn({200000})};
      OptionsDict o = options_for(c.name, c.dtype, c.stochastic);
      o.insert("amsgrad", c.amsgrad);
      o.insert("weight_decay", 0.1);
      auto opt = FunctionalRegistry::global().create(c.name, params, o);
      for (int s = 0; s < 4; ++s) opt->step(grads_for(params, s));
      std::vector<at::Tensor> out = clone_all(params);
      for (size_t i = 0; i < params.size(); ++i) {
        for (const auto& kv : entry(*opt, static_cast<int64_t>(i))) {
          if (kv.value().isTensor()) out.push_back(kv.value().toTensor().clone());
        }
      }
      results.push_back(out);
    }
    internal::low_precision_kernels_enabled() = true;
    internal::kernel_isa_cap() = internal::KernelIsa::kAvx512;
    for (int variant = 1; variant < 4; ++variant) {
      ASSERT_EQ(results[variant].size(), results[0].size());
      for (size_t k = 0; k < results[0].size(); ++k) {
        EXPECT_TRUE(at::equal(results[variant][k], results[0][k]))
            << "variant " << variant << " tensor " << k;
      }
    }
  }
}

TEST(StatePrecisionOptimizers, EightBitStateIsCodesAndScales) {
  Trainer r = start("AdamW", options_for("AdamW", kState8Bit));
  Trainer f32 = start("AdamW", options_for("AdamW", nullptr));
  steps(r, 0, 20);
  steps(f32, 0, 20);
  const auto e = entry(*r.opt, 0);
  EXPECT_FALSE(e.contains("exp_avg"));  // PyTorch's AdamW raises KeyError: 'exp_avg' on it
  EXPECT_EQ(e.at("exp_avg_codes").toTensor().scalar_type(), at::kByte);
  EXPECT_EQ(e.at("exp_avg_codes").toTensor().sizes(), r.params[0].sizes());
  EXPECT_EQ(e.at("exp_avg_sq_absmax").toTensor().numel(), quant_blocks(r.params[0].numel()));
  const auto group = r.opt->state_dict().toGenericDict().at("param_groups").toList().get(0);
  EXPECT_EQ(group.toGenericDict().at(kStateDtypeKey).toStringRef(), kState8Bit);
  EXPECT_LT(state_bytes(*r.opt), state_bytes(*f32.opt) * 0.3);
  for (size_t i = 0; i < r.params.size(); ++i) {
    EXPECT_LT(testing::relative_error(r.params[i], f32.params[i]), 2e-2) << i;
  }
}

// A default optimizer's param group is PyTorch's; one with low-precision state records it.
TEST(StatePrecisionOptimizers, ParamGroupNamesThePrecisionOnlyWhenSet) {
  Trainer plain = start("Adam", options_for("Adam", nullptr));
  const auto group = [](const Trainer& r) {
    return r.opt->state_dict().toGenericDict().at("param_groups").toList().get(0).toGenericDict();
  };
  EXPECT_FALSE(group(plain).contains(kStateDtypeKey));
  EXPECT_FALSE(group(plain).contains(kStateSeedKey));
  Trainer bf16 = start("Adam", options_for("Adam", kStateBFloat16));
  EXPECT_EQ(group(bf16).at(kStateDtypeKey).toStringRef(), kStateBFloat16);
  EXPECT_EQ(group(bf16).at(kStateSeedKey).toInt(), 7);
}

// Loading converts: float32 state into a bfloat16 optimizer, 8-bit state into a float32 one.
TEST(StatePrecisionOptimizers, LoadsStateOfAnotherPrecision) {
  Trainer f32 = start("Adam", options_for("Adam", nullptr));
  steps(f32, 0, 3);
  Trainer bf16 = start("Adam", options_for("Adam", kStateBFloat16));
  c10::IValue sd = f32.opt->state_dict();  // no state_dtype: the optimizer keeps its own
  bf16.opt->load_state_dict(sd);
  EXPECT_EQ(entry(*bf16.opt, 0).at("exp_avg").toTensor().scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::allclose(entry(*bf16.opt, 0).at("exp_avg").toTensor().to(at::kFloat),
                           entry(*f32.opt, 0).at("exp_avg").toTensor(), 1e-2, 1e-6));
  Trainer q8 = start("Adam", options_for("Adam", kState8Bit));
  steps(q8, 0, 3);
  Trainer back = start("Adam", options_for("Adam", nullptr));
  c10::IValue q8_sd = q8.opt->state_dict();
  EXPECT_EQ(q8_sd.toGenericDict()
                .at("param_groups")
                .toList()
                .get(0)
                .toGenericDict()
                .erase(kStateDtypeKey),
            1u);
  back.opt->load_state_dict(q8_sd);
  const at::Tensor exp_avg = entry(*back.opt, 0).at("exp_avg").toTensor();
  EXPECT_EQ(exp_avg.scalar_type(), at::kFloat);
  const auto q = entry(*q8.opt, 0);
  EXPECT_TRUE(at::equal(
      exp_avg, dequantize8({q.at("exp_avg_codes").toTensor(), q.at("exp_avg_absmax").toTensor()},
                           true, at::kFloat)));
}

TEST(StatePrecisionOptimizers, RefusesWhatItCannotTake) {
  std::vector<at::Tensor> params = {at::zeros({3})};
  expect_error(
      [&] { FunctionalRegistry::global().create("SGD", params, options_for("SGD", kState8Bit)); },
      "SGD: state_dtype='8bit' is for the Adam family");
  expect_error(
      [&] { FunctionalRegistry::global().create("Adam", params, options_for("Adam", "fp8")); },
      "state_dtype='fp8' is not a state precision");
  Trainer q8 = start("Adam", options_for("Adam", kState8Bit));
  steps(q8, 0, 2);
  auto mutated = [&](const char* key, const c10::IValue& value) {
    c10::IValue sd = q8.opt->state_dict();
    auto e = sd.toGenericDict().at("state").toGenericDict().at(1).toGenericDict();
    if (value.isNone()) {
      EXPECT_EQ(e.erase(key), 1u);
    } else {
      e.insert_or_assign(key, value);
    }
    return sd;
  };
  Trainer other = start("Adam", options_for("Adam", kState8Bit));
  expect_error([&] { other.opt->load_state_dict(mutated("exp_avg_absmax", c10::IValue())); },
               "state 'exp_avg' of parameter 1 has _codes but no _absmax");
  expect_error([&] { other.opt->load_state_dict(mutated("exp_avg_absmax", at::ones({2}))); },
               "state 'exp_avg' of parameter 1 has _absmax of shape [2]");
  expect_error([&] { other.opt->load_state_dict(mutated("exp_avg_absmax", at::full({3}, NAN))); },
               "non-finite _absmax at block 0");
  expect_error([&] { other.opt->load_state_dict(mutated("exp_avg_codes", at::zeros({700}))); },
               "has _codes of type Float");
  expect_error([&] { other.opt->load_state_dict(mutated("exp_avg", at::zeros({700}))); },
               "is there both as values and as 8-bit codes");
}

// Why stochastic rounding is the default: Adam's second moment, an average of small increments,
// stalls in bfloat16 rounded to nearest once an increment is below half an ulp -- at about a
// quarter of its value for beta2 = 0.999 -- and stays unbiased with stochastic rounding.
TEST(StatePrecisionOptimizers, RoundToNearestStallsTheSecondMoment) {
  auto second_moment = [](const char* dtype, bool stochastic) {
    std::vector<at::Tensor> params = {at::zeros({1000})};
    OptionsDict o = options_for("Adam", dtype, stochastic);
    auto opt = FunctionalRegistry::global().create("Adam", params, o);
    const at::Tensor g = at::full({1000}, 0.01);
    for (int s = 0; s < 2000; ++s) opt->step({g});
    return entry(*opt, 0).at("exp_avg_sq").toTensor().to(at::kDouble).mean().item<double>();
  };
  const double exact = second_moment(nullptr, true);
  EXPECT_NEAR(exact, 1e-4 * (1 - std::pow(0.999, 2000)), 1e-7);
  EXPECT_NEAR(second_moment(kStateBFloat16, true) / exact, 1.0, 0.02);
  EXPECT_LT(second_moment(kStateBFloat16, false) / exact, 0.5);
}

TEST(StatePrecisionOptimizers, SparseAdamKeepsBFloat16State) {
  std::vector<at::Tensor> params = {at::zeros({10, 4})};
  OptionsDict o = options_for("SparseAdam", kStateBFloat16);
  auto opt = FunctionalRegistry::global().create("SparseAdam", params, o);
  at::Tensor indices = at::tensor({0, 3}, at::kLong).view({1, 2});
  at::Tensor grad = at::sparse_coo_tensor(indices, at::ones({2, 4}), {10, 4});
  opt->step({grad});
  opt->step({grad});
  EXPECT_EQ(entry(*opt, 0).at("exp_avg").toTensor().scalar_type(), at::kBFloat16);
  EXPECT_NE(params[0][0][0].item<float>(), 0.0f);
  EXPECT_EQ(params[0][1][0].item<float>(), 0.0f);
}

}  // namespace
}  // namespace dtrain::optim
