// One 8-bit block (kQuantBlock elements, state_precision.h) decoded to floats and encoded back,
// as the Adam family's low-precision kernel runs it: Quant8Block<KernelIsa::kBaseline> in plain
// loops, Quant8Block<KernelIsa::kAvx2> with AVX2 gathers from the map and from Encoder8's bucket
// table (for a kernel built with target("avx2")), Quant8Block<KernelIsa::kAvx512> decoding with
// AVX-512 VBMI byte look-ups in registers where the CPU has VBMI (otherwise, and for encoding, as
// the AVX2 one). All give quantize8's codes and scales and dequantize8's values, bit for bit: the
// same float operations (a code's map entry times the block's scale; the block's absmax;
// x / absmax; Encoder8::encode_fast), only more lanes at once.
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
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

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

// The map's 256 floats as four byte planes (plane b holds byte b of every entry), each in four
// 64-byte registers' worth: what a VBMI byte permute looks codes up in.
struct MapPlanes {
  explicit MapPlanes(const Encoder8& enc) {
    for (int e = 0; e < 256; ++e) {
      uint32_t bits;
      std::memcpy(&bits, &enc.map()[e], sizeof bits);
      for (int b = 0; b < 4; ++b) bytes[b][e] = static_cast<uint8_t>(bits >> (8 * b));
    }
  }
  static const MapPlanes& of(const Encoder8& enc) {
    static const MapPlanes signed_planes(Encoder8::get(true));
    static const MapPlanes unsigned_planes(Encoder8::get(false));
    return &enc == &Encoder8::get(true) ? signed_planes : unsigned_planes;
  }
  alignas(64) uint8_t bytes[4][256];
};

// decode_vbmi's reordering: position 16L + 4a + k of the reordered codes holds code 16a + 4L + k.
alignas(64) inline constexpr auto kDecodeOrder = [] {
  std::array<uint8_t, 64> order{};
  for (int lane = 0; lane < 4; ++lane) {
    for (int a = 0; a < 4; ++a) {
      for (int k = 0; k < 4; ++k) order[16 * lane + 4 * a + k] = 16 * a + 4 * lane + k;
    }
  }
  return order;
}();

inline bool cpu_has_vbmi() {
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  return vbmi;
}

template <>
struct Quant8Block<KernelIsa::kAvx512> {
  using Base = Quant8Block<KernelIsa::kBaseline>;
  // A whole block through decode_vbmi where the CPU has VBMI, else as the AVX2 build.
  __attribute__((target(DTRAIN_AVX512_TARGET))) static void decode(const uint8_t* codes,
                                                                   int64_t len, const Encoder8& enc,
                                                                   float scale, float* values) {
    if (len != kQuantBlock) return Base::decode(codes, len, enc, scale, values);
    if (cpu_has_vbmi()) return decode_vbmi(codes, enc, scale, values);
    Quant8Block<KernelIsa::kAvx2>::decode(codes, len, enc, scale, values);
  }
  // One whole block, 64 codes at a time: each byte of each value looked up in its plane (two
  // 128-byte permutes, picked by the code's top bit), the four planes interleaved back into
  // floats, times the scale. The codes are first reordered so that the interleave, which works
  // within 128-bit lanes, leaves the floats in order.
  __attribute__((target(DTRAIN_AVX512_TARGET ",avx512vbmi"), noinline)) static void decode_vbmi(
      const uint8_t* codes, const Encoder8& enc, float scale, float* values) {
    const MapPlanes& planes = MapPlanes::of(enc);
    __m512i plane[4][4];
    for (int b = 0; b < 4; ++b) {
      for (int q = 0; q < 4; ++q) plane[b][q] = _mm512_load_si512(planes.bytes[b] + 64 * q);
    }
    const __m512i order = _mm512_load_si512(kDecodeOrder.data());
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < kQuantBlock; j += 64) {
      const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + j));
      const __mmask64 high = _mm512_movepi8_mask(c);
      __m512i p[4];
      for (int b = 0; b < 4; ++b) {
        p[b] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(plane[b][0], c, plane[b][1]),
                                      _mm512_permutex2var_epi8(plane[b][2], c, plane[b][3]));
      }
      const __m512i lo01 = _mm512_unpacklo_epi8(p[0], p[1]),
                    hi01 = _mm512_unpackhi_epi8(p[0], p[1]);
      const __m512i lo23 = _mm512_unpacklo_epi8(p[2], p[3]),
                    hi23 = _mm512_unpackhi_epi8(p[2], p[3]);
      const __m512i f[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                            _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
      for (int a = 0; a < 4; ++a) {
        _mm512_storeu_ps(values + j + 16 * a, _mm512_mul_ps(_mm512_castsi512_ps(f[a]), s));
      }
    }
  }
  __attribute__((target(DTRAIN_AVX512_TARGET))) static float encode(const float* values,
                                                                    int64_t len,
                                                                    const Encoder8& enc,
                                                                    uint8_t* codes) {
    return Quant8Block<KernelIsa::kAvx2>::encode(values, len, enc, codes);
  }
};

#undef DTRAIN_AVX2_INLINE
#undef DTRAIN_AVX2
#endif

}  // namespace dtrain::optim::internal

#endif  // DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_QUANT8_BLOCK_H_
