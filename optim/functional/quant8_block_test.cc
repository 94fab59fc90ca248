#include "optim/functional/internal/quant8_block.h"

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace dtrain::optim::internal {
namespace {

using Baseline = Quant8Block<KernelIsa::kBaseline>;
using Avx2 = Quant8Block<KernelIsa::kAvx2>;
using Avx512 = Quant8Block<KernelIsa::kAvx512>;

float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Blocks that reach every corner of the encoder: each map entry's midpoints with their neighbours
// (scale 1), random magnitudes over 30 binades, zeros of both signs, subnormals, values under
// 2^-24, NaN, and an infinity (its block's scale is infinite: every code comes from 0 or NaN).
std::vector<std::vector<float>> hard_blocks(bool is_signed) {
  std::vector<std::vector<float>> blocks;
  const std::array<float, 256>& map = dynamic_map(is_signed);
  std::vector<float> edges;
  for (size_t c = 0; c + 1 < 256; ++c) {
    const float mid = (map[c] + map[c + 1]) / 2;
    for (float u : {mid, std::nextafter(mid, 2.0f), std::nextafter(mid, -2.0f), map[c]})
      edges.push_back(u);
  }
  for (size_t at = 0; at < edges.size(); at += kQuantBlock - 1) {
    std::vector<float> block(kQuantBlock, 0.0f);
    block[0] = 1.0f;  // the scale: the midpoints are compared as they are
    for (int64_t j = 1; j < kQuantBlock && at + j - 1 < edges.size(); ++j)
      block[j] = edges[at + j - 1];
    blocks.push_back(block);
  }
  std::mt19937 rng(17);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> binade(-30, 0);
  for (int b = 0; b < 64; ++b) {
    std::vector<float> block(kQuantBlock);
    for (float& x : block) x = std::ldexp(normal(rng), binade(rng));
    if (b % 4 == 1) block[b] = std::numeric_limits<float>::quiet_NaN();
    if (b % 4 == 2) {
      block[3] = -0.0f;
      block[4] = from_bits(0x00000123u);   // subnormal
      block[5] = from_bits(0x80400000u);   // negative subnormal
      block[6] = std::ldexp(1.0f, -25);    // under 2^-24
      block[7] = -std::ldexp(1.0f, -100);  // far under
    }
    if (b % 4 == 3) block[b] = b % 8 == 3 ? std::numeric_limits<float>::infinity() : -1e30f;
    if (!is_signed)
      for (float& x : block) x = std::fabs(x);
    blocks.push_back(block);
  }
  return blocks;
}

TEST(Quant8Block, Avx2EqualsBaselineAndQuantize8) {
  if (cpu_kernel_isa() < KernelIsa::kAvx2) GTEST_SKIP() << "this CPU has no AVX2";
  for (bool is_signed : {true, false}) {
    const Encoder8& enc = Encoder8::get(is_signed);
    for (const std::vector<float>& block : hard_blocks(is_signed)) {
      uint8_t base[kQuantBlock], avx2[kQuantBlock];
      const float a = Baseline::encode(block.data(), kQuantBlock, enc, base);
      const float b = Avx2::encode(block.data(), kQuantBlock, enc, avx2);
      ASSERT_EQ(std::memcmp(&a, &b, sizeof a), 0) << a << " " << b;
      for (int64_t j = 0; j < kQuantBlock; ++j) {
        ASSERT_EQ(avx2[j], base[j]) << "value " << block[j] << " scale " << a;
        // The baseline is quantize8's encoder (Encoder8::encode_fast), itself the reference's.
        if (std::fabs(block[j] / a) <= 1) {
          ASSERT_EQ(base[j], encode8_reference(block[j] / a, is_signed)) << block[j] / a;
        }
      }
      float back_base[kQuantBlock], back_avx2[kQuantBlock];
      Baseline::decode(base, kQuantBlock, enc, a, back_base);
      Avx2::decode(base, kQuantBlock, enc, a, back_avx2);
      ASSERT_EQ(std::memcmp(back_base, back_avx2, sizeof back_base), 0);
    }
  }
}

// The AVX-512 build: encode as the AVX2 one, decode through VBMI byte look-ups where the CPU has
// VBMI (checked here directly, byte-plane interleave and code reordering included, on every
// code in every position) and through the AVX2 gathers where it has not.
TEST(Quant8Block, Avx512EqualsBaseline) {
  if (cpu_kernel_isa() < KernelIsa::kAvx512) GTEST_SKIP() << "this CPU has no AVX-512";
  for (bool is_signed : {true, false}) {
    const Encoder8& enc = Encoder8::get(is_signed);
    for (const std::vector<float>& block : hard_blocks(is_signed)) {
      uint8_t base[kQuantBlock], wide[kQuantBlock];
      const float a = Baseline::encode(block.data(), kQuantBlock, enc, base);
      const float b = Avx512::encode(block.data(), kQuantBlock, enc, wide);
      ASSERT_EQ(std::memcmp(&a, &b, sizeof a), 0) << a << " " << b;
      ASSERT_EQ(std::memcmp(base, wide, kQuantBlock), 0);
      float back_base[kQuantBlock], back_wide[kQuantBlock];
      Baseline::decode(base, kQuantBlock, enc, a, back_base);
      Avx512::decode(base, kQuantBlock, enc, a, back_wide);
      ASSERT_EQ(std::memcmp(back_base, back_wide, sizeof back_base), 0);
    }
  }
}

TEST(Quant8Block, VbmiDecodeEqualsBaselineForEveryCode) {
  if (cpu_kernel_isa() < KernelIsa::kAvx512 || !cpu_has_vbmi())
    GTEST_SKIP() << "this CPU has no AVX-512 VBMI";
  for (bool is_signed : {true, false}) {
    const Encoder8& enc = Encoder8::get(is_signed);
    for (int shift = 0; shift < 256; shift += 37) {
      uint8_t codes[kQuantBlock];
      for (int j = 0; j < kQuantBlock; ++j) codes[j] = static_cast<uint8_t>((j * 7 + shift) & 0xff);
      for (float scale : {1.0f, 0.37f, 3e-30f, 1e30f}) {
        float base[kQuantBlock], vbmi[kQuantBlock];
        Baseline::decode(codes, kQuantBlock, enc, scale, base);
        Avx512::decode_vbmi(codes, enc, scale, vbmi);
        for (int j = 0; j < kQuantBlock; ++j) {
          ASSERT_EQ(std::memcmp(&base[j], &vbmi[j], sizeof(float)), 0)
              << "position " << j << " code " << int{codes[j]} << " scale " << scale << ": "
              << base[j] << " != " << vbmi[j];
        }
      }
    }
  }
}

// A partial block (a tensor's last) takes the plain loops in either build.
TEST(Quant8Block, PartialBlockEqualsBaseline) {
  if (cpu_kernel_isa() < KernelIsa::kAvx2) GTEST_SKIP() << "this CPU has no AVX2";
  const Encoder8& enc = Encoder8::get(true);
  std::vector<float> values = hard_blocks(true).back();
  uint8_t base[kQuantBlock], avx2[kQuantBlock];
  const float a = Baseline::encode(values.data(), 100, enc, base);
  const float b = Avx2::encode(values.data(), 100, enc, avx2);
  EXPECT_EQ(a, b);
  EXPECT_EQ(std::memcmp(base, avx2, 100), 0);
}

}  // namespace
}  // namespace dtrain::optim::internal
