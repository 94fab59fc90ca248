// Adam and AdamW with param_remainders over bfloat16 parameters: the float32 trajectory bit for
// bit for every state_dtype (and the drift without remainders), resume, refusals, the split's
// edges and the bytes a parameter costs.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "optim/functional/optimizers.h"
#include "optim/functional/registry.h"
#include "optim/functional/state_precision.h"
#include "testing/test_util.h"

namespace dtrain::optim {
namespace {

using test_util::expect_error;

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}
float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// One case: the optimizer, its options (without param_remainders and state_dtype).
struct Case {
  std::string name;
  bool amsgrad;
  std::optional<bool> fused;
};
const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"AdamW", false, std::nullopt}, {"Adam", true, std::nullopt}, {"AdamW", false, true}};
  return all;
}
const std::vector<const char*>& state_dtypes() {
  static const std::vector<const char*> all = {nullptr, kStateBFloat16, kState8Bit};
  return all;
}

OptionsDict options_for(const Case& c, const char* state_dtype, bool remainders) {
  OptionsDict o = new_options_dict();
  o.insert("lr", 0.01);
  // Adam's L2 decay would square bfloat16's largest values into inf: decoupled decay only.
  o.insert("weight_decay", c.name == "Adam" ? 0.0 : 0.01);
  o.insert("amsgrad", c.amsgrad);
  if (c.fused.has_value()) o.insert("fused", *c.fused);
  if (state_dtype != nullptr) o.insert(kStateDtypeKey, std::string(state_dtype));
  o.insert(kStateSeedKey, int64_t{7});
  if (remainders) o.insert(kParamRemaindersKey, true);
  return o;
}

// bfloat16 parameters: random ones, and one of edge values (negative, tiny, near bfloat16's max).
std::vector<at::Tensor> make_bf16_params() {
  at::manual_seed(3);
  const float bf16_max = float_of(0x7f7f0000u);
  return {at::randn({24, 40}).to(at::kBFloat16), at::randn({700}).to(at::kBFloat16),
          at::tensor({-2.5f, -1e-3f, 3e-39f, bf16_max, -bf16_max, 0.0f, 1.0f, -0.0f})
              .to(at::kBFloat16)};
}

// bfloat16 gradients of 0.5 * |w - 0.5|^2 plus noise, at the float32 weights `w`.
std::vector<at::Tensor> bf16_grads(const std::vector<at::Tensor>& w, int step) {
  std::vector<at::Tensor> g;
  for (size_t i = 0; i < w.size(); ++i) {
    at::manual_seed(1000 * step + static_cast<int64_t>(i));
    const at::Tensor f = w[i].to(at::kFloat);
    g.push_back((f.clamp(-4, 4) - 0.5 + 0.1 * at::randn(f.sizes())).to(at::kBFloat16));
  }
  return g;
}
std::vector<at::Tensor> to_float(const std::vector<at::Tensor>& v) {
  std::vector<at::Tensor> out;
  for (const auto& t : v) out.push_back(t.to(at::kFloat));
  return out;
}

c10::impl::GenericDict entry(const FunctionalOptimizer& opt, int64_t index) {
  return opt.state_dict().toGenericDict().at("state").toGenericDict().at(index).toGenericDict();
}

// The master weights of a bfloat16 run (its parameters and saved remainders).
std::vector<at::Tensor> masters(const FunctionalOptimizer& opt) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < opt.params().size(); ++i) {
    const at::Tensor rem = entry(opt, static_cast<int64_t>(i)).at(kParamRemainderKey).toTensor();
    EXPECT_EQ(rem.scalar_type(), at::kShort);
    out.push_back(master_weight(opt.params()[i], rem));
  }
  return out;
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes().equals(b.sizes()) &&
         at::equal(a.contiguous().reshape(-1).view(at::kByte),
                   b.contiguous().reshape(-1).view(at::kByte));
}

// Each element of `p32` split by the rule: the bfloat16 parameter it gives.
at::Tensor rounded_by_rule(const at::Tensor& p32) {
  const at::Tensor c = p32.contiguous();
  at::Tensor out = at::empty(c.sizes(), c.options().dtype(at::kBFloat16));
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t k = 0; k < c.numel(); ++k) {
    int16_t rem;
    split_master(c.data_ptr<float>()[k], &o[k], &rem);
  }
  return out;
}

// Every state tensor but the remainder equal in both runs (8-bit codes and scales included).
void expect_same_state(const FunctionalOptimizer& bf16, const FunctionalOptimizer& f32,
                       const std::string& what) {
  for (size_t i = 0; i < f32.params().size(); ++i) {
    const auto a = entry(bf16, static_cast<int64_t>(i));
    const auto b = entry(f32, static_cast<int64_t>(i));
    EXPECT_EQ(a.size(), b.size() + 1) << what;
    for (const auto& kv : b) {
      ASSERT_TRUE(a.contains(kv.key())) << what << kv.key().toStringRef();
      EXPECT_TRUE(same_bits(a.at(kv.key()).toTensor(), kv.value().toTensor()))
          << what << " parameter " << i << " " << kv.key().toStringRef();
    }
  }
}

struct Runs {
  std::vector<at::Tensor> bf16, f32;
  std::unique_ptr<FunctionalOptimizer> with_remainders, reference;
};
Runs start(const Case& c, const char* state_dtype) {
  Runs r;
  r.bf16 = make_bf16_params();
  r.f32 = to_float(r.bf16);  // the master of remainder 0
  auto& registry = FunctionalRegistry::global();
  r.with_remainders = registry.create(c.name, r.bf16, options_for(c, state_dtype, true));
  r.reference = registry.create(c.name, r.f32, options_for(c, state_dtype, false));
  return r;
}
void step_both(Runs& r, int step) {
  const std::vector<at::Tensor> g = bf16_grads(r.f32, step);
  r.with_remainders->step(g);
  r.reference->step(to_float(g));
}

// The bfloat16 + remainder run is the float32 run over the master, bit for bit, every step; the
// parameter is always the master rounded by the rule.
TEST(ParamRemainders, EqualsFloat32TrajectoryForEveryStateDtype) {
  for (const Case& c : cases()) {
    for (const char* state_dtype : state_dtypes()) {
      const std::string what = c.name + (c.amsgrad ? " amsgrad" : "") + (c.fused ? " fused" : "") +
                               " state_dtype=" + (state_dtype ? state_dtype : "None");
      Runs r = start(c, state_dtype);
      for (int step = 1; step <= 25; ++step) {
        step_both(r, step);
        const std::vector<at::Tensor> m = masters(*r.with_remainders);
        for (size_t i = 0; i < r.f32.size(); ++i) {
          ASSERT_TRUE(same_bits(m[i], r.f32[i])) << what << " step " << step << " param " << i;
          ASSERT_TRUE(same_bits(r.bf16[i], rounded_by_rule(r.f32[i])))
              << what << " step " << step << " param " << i;
        }
      }
      expect_same_state(*r.with_remainders, *r.reference, what);
    }
  }
}

// Without the remainder the same bfloat16 parameters drift from the float32 run: the updates
// (lr 0.01 of values near 1) are lost to bfloat16's rounding.
TEST(ParamRemainders, WithoutThemBFloat16ParametersDrift) {
  const Case c{"AdamW", false, std::nullopt};
  Runs r = start(c, nullptr);
  std::vector<at::Tensor> plain = make_bf16_params();
  auto plain_opt = FunctionalRegistry::global().create("AdamW", plain, options_for(c, nullptr, 0));
  for (int step = 1; step <= 25; ++step) {
    const std::vector<at::Tensor> g = bf16_grads(r.f32, step);
    plain_opt->step(g);
    r.with_remainders->step(g);
    r.reference->step(to_float(g));
  }
  const int64_t drifted =
      plain[0].ne(rounded_by_rule(r.f32[0])).sum().item<int64_t>();  // plain bf16 run
  const int64_t kept = r.bf16[0].ne(rounded_by_rule(r.f32[0])).sum().item<int64_t>();
  EXPECT_GT(drifted, plain[0].numel() / 10) << "plain bfloat16 AdamW did not drift";
  EXPECT_EQ(kept, 0);
}

// A state dict mid-run loaded into a fresh optimizer (default options: the group turns
// param_remainders on) continues bit for bit.
TEST(ParamRemainders, ResumesBitForBit) {
  for (const char* state_dtype : state_dtypes()) {
    const std::string label = state_dtype != nullptr ? state_dtype : "None";
    const Case c{"AdamW", false, std::nullopt};
    Runs r = start(c, state_dtype);
    for (int step = 1; step <= 5; ++step) step_both(r, step);
    const c10::IValue saved = r.with_remainders->state_dict();
    const auto group = saved.toGenericDict().at("param_groups").toList().get(0).toGenericDict();
    EXPECT_TRUE(group.at(kParamRemaindersKey).toBool());
    std::vector<at::Tensor> resumed;
    for (const auto& p : r.bf16) resumed.push_back(p.clone());
    FunctionalAdamW fresh(resumed, AdamWOptions());
    fresh.load_state_dict(saved);
    EXPECT_TRUE(fresh.options().param_remainders());
    for (int step = 6; step <= 12; ++step) {
      const std::vector<at::Tensor> g = bf16_grads(r.f32, step);
      fresh.step(g);
      r.with_remainders->step(g);
      r.reference->step(to_float(g));
    }
    for (size_t i = 0; i < resumed.size(); ++i) {
      EXPECT_TRUE(same_bits(resumed[i], r.bf16[i])) << label << " " << i;
      EXPECT_TRUE(same_bits(masters(fresh)[i], r.f32[i])) << label << " " << i;
    }
    expect_same_state(fresh, *r.reference, label);
  }
}

TEST(ParamRemainders, OffByDefaultAndOutOfPyTorchsGroup) {
  std::vector<at::Tensor> p = make_bf16_params();
  FunctionalAdamW plain(p, AdamWOptions());
  EXPECT_FALSE(plain.options_dict().contains(kParamRemaindersKey));
  EXPECT_TRUE(plain.all_options().contains(kParamRemaindersKey));
  plain.step(bf16_grads(to_float(p), 1));
  EXPECT_FALSE(entry(plain, 0).contains(kParamRemainderKey));
  FunctionalAdam on(make_bf16_params(), AdamOptions().param_remainders(true));
  EXPECT_TRUE(on.options_dict().at(kParamRemaindersKey).toBool());
}

TEST(ParamRemainders, Refusals) {
  const std::vector<at::Tensor> f32 = {at::zeros({3}), at::zeros({2}, at::kBFloat16)};
  expect_error([&] { FunctionalAdamW(f32, AdamWOptions().param_remainders(true)); },
               "AdamW: param_remainders=True keeps a 16-bit remainder for bfloat16 parameters "
               "only, but parameter 0 is Float; make the parameter bfloat16");
  // Switched on later: refused at the step, before anything changes.
  FunctionalAdam adam(f32, AdamOptions());
  OptionsDict on = new_options_dict();
  on.insert("lr", 0.1);
  on.insert(kParamRemaindersKey, true);
  adam.set_options(on);
  const at::Tensor before = f32[1].clone();
  expect_error(
      [&] {
        adam.step({at::ones({3}), at::ones({2}, at::kBFloat16)});
      },
      "parameter 0 is Float");
  EXPECT_TRUE(same_bits(f32[1], before));
  EXPECT_FALSE(adam.has_state(1));
  // Only Adam and AdamW have it.
  for (const char* name : {"SGD", "Adamax", "NAdam"}) {
    expect_error(
        [&] { FunctionalRegistry::global().create(name, {at::zeros({2}, at::kBFloat16)}, on); },
        "got an unexpected option 'param_remainders'");
  }
}

TEST(ParamRemainders, LoadRefusesARemainderThatIsNotOneOfInt16) {
  const Case c{"AdamW", false, std::nullopt};
  Runs r = start(c, nullptr);
  step_both(r, 1);
  auto with = [&](const c10::IValue& rem) {
    c10::IValue sd = r.with_remainders->state_dict();
    sd.toGenericDict()
        .at("state")
        .toGenericDict()
        .at(int64_t{1})
        .toGenericDict()
        .insert_or_assign(kParamRemainderKey, rem);
    return sd;
  };
  std::vector<at::Tensor> p = make_bf16_params();
  FunctionalAdamW fresh(p, AdamWOptions());
  // What PyTorch's load_state_dict makes of it: the parameter's bfloat16.
  const at::Tensor rem = entry(*r.with_remainders, 1).at(kParamRemainderKey).toTensor();
  expect_error([&] { fresh.load_state_dict(with(rem.to(at::kBFloat16))); },
               "AdamW.load_state_dict: state 'param_remainder' of parameter 1 is a BFloat16 "
               "tensor; a remainder is a dense int16 tensor (PyTorch's load_state_dict casts it");
  expect_error([&] { fresh.load_state_dict(with(rem.narrow(0, 0, 5))); },
               "state 'param_remainder' of parameter 1 has shape [5], the parameter has shape "
               "[700]");
  expect_error([&] { fresh.load_state_dict(with(c10::IValue(3.0))); }, "is a Double, not a tensor");
  // A remainder for a float32 parameter.
  std::vector<at::Tensor> f32 = to_float(make_bf16_params());
  FunctionalAdamW float_opt(f32, AdamWOptions());
  expect_error([&] { float_opt.load_state_dict(with(rem)); },
               "the parameter is Float; only a bfloat16 parameter keeps a 16-bit remainder");
  EXPECT_FALSE(fresh.has_state(0));  // nothing applied
}

// The split at its edges: remainders at the +-0x8000 boundary, negative values, bfloat16's and
// float32's largest values, inf and NaN.
struct Edge {
  uint32_t master;
  uint16_t bf16;
  int16_t rem;
};
const Edge kEdges[] = {
    {0x3f800000u, 0x3f80, 0},        // 1.0: exact
    {0x3f807fffu, 0x3f80, 0x7fff},   // just below half: down
    {0x3f808000u, 0x3f81, -0x8000},  // half: up (away from zero)
    {0x3f80ffffu, 0x3f81, -1},       // just below the next: up
    {0xbf808000u, 0xbf81, -0x8000},  // -1.0 and a half: the magnitude up
    {0xbf807fffu, 0xbf80, 0x7fff},   // negative, just below half: down
    {0x7f7f7fffu, 0x7f7f, 0x7fff},   // bfloat16's max and less than half
    {0x7f7fffffu, 0x7f80, -1},       // float32's max: rounds to inf, kept exactly
    {0xff7fffffu, 0xff80, -1},       // -float32's max: -inf
    {0x7f800000u, 0x7f80, 0},        // inf
    {0xff800000u, 0xff80, 0},        // -inf
    {0x0000ffffu, 0x0001, -1},       // a subnormal
    {0x80008000u, 0x8001, -0x8000},  // a negative subnormal
    {0x00000000u, 0x0000, 0},        // 0
    {0x80000000u, 0x8000, 0},        // -0
    {0x7fffffffu, 0x7fc0, 0},        // NaN: TE would show -0.0 (0x7fff + 1)
    {0xffffffffu, 0xffc0, 0},        // -NaN: TE would show 0.0
    {0x7fc00000u, 0x7fc0, 0},        // the quiet NaN
};

TEST(ParamRemainders, SplitEdges) {
  for (const Edge& e : kEdges) {
    uint16_t b;
    int16_t r;
    const float m = float_of(e.master);
    split_master(m, &b, &r);
    EXPECT_EQ(b, e.bf16) << std::hex << e.master;
    EXPECT_EQ(r, e.rem) << std::hex << e.master;
    const float back = join_master(b, r);
    if (std::isnan(m)) {
      EXPECT_TRUE(std::isnan(back)) << std::hex << e.master;
    } else {
      EXPECT_EQ(bits_of(back), e.master) << std::hex << e.master;
    }
  }
}

TEST(ParamRemainders, SplitIsNearestTiesAwayAndJoinsExactly) {
  // Every high half with the low halves around the boundary: joins back exactly, and the
  // parameter is the nearest bfloat16 (ties away from zero) of every finite master.
  for (uint32_t high = 0; high < 0x10000u; ++high) {
    for (uint32_t low : {0x0u, 0x1u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      const float m = float_of((high << 16) | low);
      if (std::isnan(m)) continue;
      uint16_t b;
      int16_t r;
      split_master(m, &b, &r);
      ASSERT_EQ(bits_of(join_master(b, r)), bits_of(m)) << std::hex << high << " " << low;
      const float down = float_of(high << 16), up = float_of((high + 1) << 16);
      ASSERT_EQ(b, static_cast<uint16_t>(low >= 0x8000u ? high + 1 : high));
      if (std::isfinite(up) && std::isfinite(m)) {
        const double to_down = std::fabs(double(m) - down), to_up = std::fabs(double(up) - m);
        ASSERT_EQ(b == high, to_down < to_up) << std::hex << high << " " << low;
      }
    }
  }
}

// The tensor forms (loop and ATen operations) agree with the scalar split.
TEST(ParamRemainders, TensorFormsAgree) {
  std::vector<float> values;
  for (const Edge& e : kEdges) values.push_back(float_of(e.master));
  const int64_t n = static_cast<int64_t>(values.size());
  const at::Tensor master = at::from_blob(values.data(), {n}, at::kFloat).clone();
  const at::Tensor strided_master = at::stack({master, master}, 1).select(1, 0);
  for (const at::Tensor& m : {master, strided_master}) {
    at::Tensor p = at::empty({2, n}, at::kBFloat16).select(0, 0);
    if (!m.is_contiguous()) p = at::empty({n, 2}, at::kBFloat16).select(1, 1);
    at::Tensor r = at::empty({n}, at::kShort);
    split_master_weight(m, p, r);
    const at::Tensor back = master_weight(p, r).contiguous();
    const at::Tensor pc = p.contiguous();
    const auto* pb = reinterpret_cast<const uint16_t*>(pc.data_ptr<at::BFloat16>());
    for (int64_t k = 0; k < n; ++k) {
      EXPECT_EQ(pb[k], kEdges[k].bf16) << k << (m.is_contiguous() ? " loop" : " ATen");
      EXPECT_EQ(r.data_ptr<int16_t>()[k], kEdges[k].rem) << k;
      const float b = back.data_ptr<float>()[k];
      if (std::isnan(values[k])) {
        EXPECT_TRUE(std::isnan(b)) << k;
      } else {
        EXPECT_EQ(bits_of(b), kEdges[k].master) << k;
      }
    }
  }
}

// Persistent bytes per parameter element of AdamW over bfloat16 parameters with remainders and
// 8-bit state: parameter 2 + remainder 2 + gradient 2 + state (2 x (1 + 4 / 256)) = 8.03125.
TEST(ParamRemainders, BytesPerParameter) {
  std::vector<at::Tensor> p = {at::randn({64, 256}).to(at::kBFloat16)};
  FunctionalAdamW opt(p, AdamWOptions().param_remainders(true).state_dtype(kState8Bit));
  const std::vector<at::Tensor> g = bf16_grads(to_float(p), 1);
  opt.step(g);
  double bytes = p[0].nbytes() + g[0].nbytes();
  for (const auto& kv : entry(opt, 0)) {
    if (kv.key().toStringRef() != "step") bytes += kv.value().toTensor().nbytes();
  }
  const double per_element = bytes / static_cast<double>(p[0].numel());
  std::cout << "AdamW, bfloat16 parameters + remainders + bfloat16 gradients + 8-bit state: "
            << per_element << " bytes per parameter\n";
  EXPECT_DOUBLE_EQ(per_element, 2 + 2 + 2 + 2 * (1 + 4.0 / kQuantBlock));
}

}  // namespace
}  // namespace dtrain::optim
