// One 8-bit block (kQuantBlock elements, state_precision.h) decoded to floats and encoded back,
// as the Adam family's low-precision kernel runs it: Quant8Block<KernelIsa::kBaseline> in plain
// loops, Quant8Block<KernelIsa::kAvx2> with AVX2 gathers from the map and from Encoder8's bucket
// table (for a kernel built with target("avx2")). Both give quantize8's codes and scales and
// dequantize8's values, bit for bit: the same float operations (a code's map entry times the
// block's scale; the block's absmax; x / absmax; Encoder8::encode_fast), only more lanes at once.
// Internal to optim/.
//
//   using Q = Quant8Block<KernelIsa::kAvx2>;
//   float values[kQuantBlock];
//   Q::decode(codes, len, Encoder8::get(true), absmax[b], values);
//   ...update values...
//   absmax[b] = Q::encode(values, len, Encoder8::get(true), codes);
#ifndef DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_QUANT8_BLOCK_H_
#define DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_QUANT8_BLOCK_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "optim/functional/internal/fused.h"
#include "optim/functional/state_precision.h"

namespace dtrain::optim::internal {

// The block's scale as quantize8 takes it: max |x| (NaNs skipped), at least kMinAbsmax.
inline float block_absmax(const float* values, int64_t len) {
  float a = 0;
  for (int64_t j = 0; j < len; ++j) a = std::max(a, std::fabs(values[j]));
  return std::max(a, kMinAbsmax);
}

template <KernelIsa kIsa>
struct Quant8Block {
  // values[j] = map[codes[j]] * scale, j < len.
  static void decode(const uint8_t* codes, int64_t len, const Encoder8& enc, float scale,
                     float* values) {
    for (int64_t j = 0; j < len; ++j) values[j] = enc.decode(codes[j]) * scale;
  }
  // codes[j] = the code of values[j] / absmax; returns absmax.
  static float encode(const float* values, int64_t len, const Encoder8& enc, uint8_t* codes) {
    const float a = block_absmax(values, len);
    for (int64_t j = 0; j < len; ++j) codes[j] = enc.encode_fast(values[j] / a);
    return a;
  }
};

#if defined(__x86_64__) && defined(__GNUC__)
// Helpers are always inlined; the block functions, built for AVX2, are inlined by the kernels'
// target("avx2"), flatten entry point (internal/adam_low_precision.h).
#define DTRAIN_AVX2_INLINE __attribute__((target("avx2"), always_inline)) inline
#define DTRAIN_AVX2 __attribute__((target("avx2")))

// Eight codes (as 32-bit lanes) of eight normalised values: Encoder8::encode_fast, lane-wise.
DTRAIN_AVX2_INLINE __m256i encode8_avx2(__m256 u, const uint32_t* buckets) {
  const __m256i bits = _mm256_castps_si256(u);
  const __m256i sign = _mm256_srai_epi32(bits, 31);  // all ones for negative values
  __m256i row =
      _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(0xff)),
                       _mm256_set1_epi32(Encoder8::kLowExponent - 1));
  row = _mm256_min_epi32(_mm256_max_epi32(row, _mm256_setzero_si256()),
                         _mm256_set1_epi32(Encoder8::kRows - 1));
  __m256i index = _mm256_and_si256(sign, _mm256_set1_epi32(Encoder8::kRows * 128));
  index = _mm256_add_epi32(index, _mm256_slli_epi32(row, 7));
  index = _mm256_add_epi32(index,
                           _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x7f)));
  const __m256i entry =
      _mm256_i32gather_epi32(reinterpret_cast<const int*>(buckets), index, sizeof(uint32_t));
  const __m256i key = _mm256_and_si256(_mm256_xor_si256(bits, sign), _mm256_set1_epi32(0xffff));
  const __m256i below =
      _mm256_cmpgt_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0x1ffff)), key);
  // base + 1 - (key < threshold); NaN lanes 0.
  const __m256i code =
      _mm256_add_epi32(_mm256_srli_epi32(entry, 17), _mm256_add_epi32(below, _mm256_set1_epi32(1)));
  return _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(u, u, _CMP_UNORD_Q)), code);
}

template <>
struct Quant8Block<KernelIsa::kAvx2> {
  using Base = Quant8Block<KernelIsa::kBaseline>;
  DTRAIN_AVX2 static void decode(const uint8_t* codes, int64_t len, const Encoder8& enc,
                                 float scale, float* values) {
    if (len != kQuantBlock) return Base::decode(codes, len, enc, scale, values);
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t j = 0; j < kQuantBlock; j += 8) {
      const __m256i c =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j)));
      _mm256_storeu_ps(values + j,
                       _mm256_mul_ps(_mm256_i32gather_ps(enc.map(), c, sizeof(float)), s));
    }
  }
  DTRAIN_AVX2 static float encode(const float* values, int64_t len, const Encoder8& enc,
                                  uint8_t* codes) {
    if (len != kQuantBlock) return Base::encode(values, len, enc, codes);
    // max(|x|, acc) lane-wise: maxps returns its second operand when the first is NaN, as
    // std::max(a, |x|) keeps a; the lanes' maximum is then the block's.
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < kQuantBlock; j += 8)
      acc = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(values + j), abs_mask), acc);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    float a = kMinAbsmax;
    for (float l : lanes) a = std::max(a, l);
    const __m256 va = _mm256_set1_ps(a);
    const uint32_t* buckets = enc.buckets();
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t j = 0; j < kQuantBlock; j += 32) {
      __m256i c[4];
      for (int q = 0; q < 4; ++q)
        c[q] = encode8_avx2(_mm256_div_ps(_mm256_loadu_ps(values + j + 8 * q), va), buckets);
      const __m256i bytes =
          _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + j),
                          _mm256_permutevar8x32_epi32(bytes, order));
    }
    return a;
  }
};

#undef DTRAIN_AVX2_INLINE
#undef DTRAIN_AVX2
#endif

}  // namespace dtrain::optim::internal

#endif  // DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_QUANT8_BLOCK_H_
