#include "optim/functional/state_precision.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace dtrain::optim {
namespace {

float next_up(float f) { return std::nextafter(f, std::numeric_limits<float>::infinity()); }
float next_down(float f) { return std::nextafter(f, -std::numeric_limits<float>::infinity()); }

TEST(DynamicMap, HasTorchaosShape) {
  for (bool is_signed : {true, false}) {
    const std::array<float, 256>& map = dynamic_map(is_signed);
    for (size_t k = 1; k < 256; ++k) EXPECT_LT(map[k - 1], map[k]) << k;
    EXPECT_EQ(map[255], 1.0f);
    EXPECT_NE(std::find(map.begin(), map.end(), 0.0f), map.end());
  }
  // Signed: the top decade split in 64 parts, so its extreme is -(1 - 0.9/128); the smallest
  // magnitude is the middle of [0.1, 1] in the 1e-6 decade.
  EXPECT_FLOAT_EQ(dynamic_map(true)[0], -(1 - 0.9 / 128));
  EXPECT_FLOAT_EQ(dynamic_map(true)[128], 0.55e-6f);
  EXPECT_EQ(dynamic_map(false)[0], 0.0f);
  EXPECT_FLOAT_EQ(dynamic_map(false)[1], (0.1 + 0.9 / 4) * 1e-6);
}

// The reference is the nearest entry (ties aside: then either neighbour).
TEST(Encode8, ReferenceIsNearest) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1, 1);
  for (bool is_signed : {true, false}) {
    const std::array<float, 256>& map = dynamic_map(is_signed);
    for (int trial = 0; trial < 20000; ++trial) {
      float u = uniform(rng);
      if (trial % 2) u = std::ldexp(u, -static_cast<int>(trial % 24));  // small magnitudes too
      if (!is_signed) u = std::fabs(u);
      const uint8_t c = encode8_reference(u, is_signed);
      float best = std::numeric_limits<float>::infinity();
      for (float m : map) best = std::min(best, std::fabs(m - u));
      EXPECT_LE(std::fabs(map[c] - u), best * (1 + 1e-6f) + 1e-30f) << u;
    }
  }
}

// The table-driven encoder gives the reference's code for every bucket's ends, both sides of every
// threshold and random values: 65536 buckets x 3 + 256 x 2 + 10^6 per map.
TEST(Encode8, TableEqualsReference) {
  std::mt19937 rng(11);
  for (bool is_signed : {true, false}) {
    const Encoder8& enc = Encoder8::get(is_signed);
    auto check = [&](float u) {
      if (std::isnan(u) || std::fabs(u) > 1) return;
      ASSERT_EQ(enc.encode(u), encode8_reference(u, is_signed)) << u;
      ASSERT_EQ(enc.encode_fast(u), encode8_reference(u, is_signed)) << u;
    };
    for (uint32_t h = 0; h < 65536; ++h) {
      for (uint32_t low : {0u, 0x8000u, 0xffffu}) {
        const uint32_t bits = (h << 16) | low;
        float u;
        std::memcpy(&u, &bits, sizeof u);
        check(u);
      }
    }
    const std::array<float, 256>& map = dynamic_map(is_signed);
    for (size_t c = 0; c + 1 < 256; ++c) {
      const float mid = (map[c] + map[c + 1]) / 2;
      check(mid);
      check(next_up(mid));
      check(next_down(mid));
    }
    std::uniform_int_distribution<uint32_t> bits_of(0, 0xffffffffu);
    for (int trial = 0; trial < 1000000; ++trial) {
      uint32_t bits = bits_of(rng);
      bits = (bits & 0x807fffffu) | ((120u + bits % 7u) << 23);  // magnitudes 2^-7 .. 2^-1
      float u;
      std::memcpy(&u, &bits, sizeof u);
      check(trial % 2 ? u : u * 1.9f);
    }
  }
}

TEST(Quantize8, CpuLoopEqualsAtenForm) {
  at::manual_seed(3);
  for (int64_t n : {1, 255, 256, 257, 1000, 4096 + 17}) {
    at::Tensor x = at::randn({n}) * at::exp(at::randn({n}) * 4);
    x.index_put_({at::indexing::Slice(0, std::min<int64_t>(n, 300))}, 0);  // an all-zero block
    for (bool is_signed : {true, false}) {
      at::Tensor in = is_signed ? x : x.abs();
      Quantized8 a = quantize8(in, is_signed);
      Quantized8 b = internal::quantize8_aten(in, is_signed);
      EXPECT_TRUE(at::equal(a.codes, b.codes)) << n;
      EXPECT_TRUE(at::equal(a.absmax, b.absmax)) << n;
      ASSERT_EQ(a.absmax.numel(), quant_blocks(n));
      // Every value within half a map gap of the block's scale; zeros stay zeros.
      at::Tensor back = dequantize8(a, is_signed, at::kFloat);
      at::Tensor scale = a.absmax.repeat_interleave(kQuantBlock).narrow(0, 0, n);
      EXPECT_LE(((back - in).abs() / scale).max().item<float>(),
                (is_signed ? 0.9f / 64 : 0.9f / 128) / 2 * 1.0001f);
      EXPECT_EQ(back.narrow(0, 0, std::min<int64_t>(n, 256)).abs().max().item<float>(), 0.0f);
    }
  }
}

TEST(Quantize8, RoundTripKeepsCodesAndScales) {
  at::manual_seed(4);
  at::Tensor x = at::randn({3, 700});
  Quantized8 q = quantize8(x, true);
  at::Tensor values = dequantize8(q, true, at::kFloat);
  EXPECT_EQ(values.sizes(), x.sizes());
  // The absmax element of each block decodes to (nearly) its scale.
  EXPECT_TRUE(at::allclose(values.reshape({-1}).abs().narrow(0, 0, 2048).view({8, 256}).amax(1),
                           q.absmax.narrow(0, 0, 8), 1e-2, 0));
}

TEST(BFloat16, StochasticRoundingIsUnbiasedAndNearestIsNot) {
  const float x = 1.0f + std::ldexp(1.0f, -10);  // an eighth of the way to the next bfloat16
  at::Tensor t = at::full({1 << 20}, x);
  const double stochastic = to_bfloat16(t, true, 42).to(at::kDouble).mean().item<double>();
  const double nearest = to_bfloat16(t, false, 42).to(at::kDouble).mean().item<double>();
  EXPECT_EQ(nearest, 1.0);
  EXPECT_NEAR(stochastic, x, 2e-5);  // sd of the mean: 2^-7 * sqrt(1/8 * 7/8) / 2^10 = 2.6e-6
}

TEST(BFloat16, ReproducibleKeyedAndEqualToAtenForm) {
  at::manual_seed(5);
  at::Tensor x = at::randn({5000}) * 1e3;
  x[7] = std::numeric_limits<float>::infinity();
  x[8] = -std::numeric_limits<float>::infinity();
  x[9] = std::numeric_limits<float>::quiet_NaN();
  at::Tensor a = to_bfloat16(x, true, rounding_key(1, 2, 3, 0));
  at::Tensor b = to_bfloat16(x, true, rounding_key(1, 2, 3, 0));
  at::Tensor c = to_bfloat16(x, true, rounding_key(1, 3, 3, 0));
  at::Tensor bits_a = a.view(at::kShort), bits_b = b.view(at::kShort), bits_c = c.view(at::kShort);
  EXPECT_TRUE(at::equal(bits_a, bits_b));
  EXPECT_FALSE(at::equal(bits_a, bits_c));
  // Slots 0 and 1 share a hash per element and take its two halves: different bits.
  at::Tensor slot1 = to_bfloat16(x, true, rounding_key(1, 2, 3, 1)).view(at::kShort);
  EXPECT_FALSE(at::equal(bits_a, slot1));
  for (auto [stochastic, key] : {std::pair{true, 98}, std::pair{true, 99}, std::pair{false, 99}}) {
    at::Tensor loop = to_bfloat16(x, stochastic, key).view(at::kShort);
    at::Tensor aten = internal::to_bfloat16_aten(x, stochastic, key).view(at::kShort);
    const at::Tensor differ = (loop != aten).nonzero();
    EXPECT_EQ(differ.numel(), 0) << stochastic << " first at " << differ[0].item<int64_t>() << ": "
                                 << x[differ[0].item<int64_t>()].item<float>() << " "
                                 << loop[differ[0].item<int64_t>()].item<int16_t>() << " "
                                 << aten[differ[0].item<int64_t>()].item<int16_t>();
  }
  EXPECT_TRUE(std::isinf(a[7].item<float>()) && a[7].item<float>() > 0);
  EXPECT_TRUE(std::isinf(a[8].item<float>()) && a[8].item<float>() < 0);
  EXPECT_TRUE(std::isnan(a[9].item<float>()));
  // Nearest equals PyTorch's own conversion (round to nearest even).
  EXPECT_TRUE(at::equal(to_bfloat16(x, false, 0).view(at::kShort).narrow(0, 10, 4000),
                        x.to(at::kBFloat16).view(at::kShort).narrow(0, 10, 4000)));
  // Stochastic rounding lands on one of the two neighbours.
  at::Tensor err = (a.to(at::kFloat) - x).abs().narrow(0, 10, 4000);
  EXPECT_TRUE((err <= x.abs().narrow(0, 10, 4000) * std::ldexp(1.0f, -7)).all().item<bool>());
}

TEST(StatePrecision, OptionsParsedAndRefused) {
  StatePrecision p = parse_state_precision("Adam", std::string("8bit"), true, 3, true);
  EXPECT_EQ(p.dtype, StateDtype::k8Bit);
  EXPECT_EQ(parse_state_precision("SGD", std::nullopt, true, 0, false).dtype, StateDtype::kParam);
  EXPECT_EQ(parse_state_precision("SGD", std::string("bfloat16"), false, 0, false).dtype,
            StateDtype::kBFloat16);
  try {
    parse_state_precision("SGD", std::string("8bit"), true, 0, false);
    FAIL() << "8bit SGD accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Adam family"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_state_precision("Adam", std::string("float8"), true, 0, true), c10::Error);
  EXPECT_THROW(parse_state_precision("Adam", std::nullopt, true, -1, true), c10::Error);
}

}  // namespace
}  // namespace dtrain::optim
