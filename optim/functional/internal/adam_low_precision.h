// Adam's and AdamW's fused CPU kernels for state kept in bfloat16 or 8 bits: each element's
// update is the float kernel's (AdamDescriptor::element, float32 registers), read from and
// written back to the narrow state in place; 8-bit blocks of kQuantBlock elements are decoded,
// updated and re-encoded one at a time, so no float copy of the state exists. Internal to optim/.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_ADAM_LOW_PRECISION_H_
#define DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_ADAM_LOW_PRECISION_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "optim/functional/internal/fused.h"
#include "optim/functional/internal/low_precision.h"
#include "optim/functional/state_precision.h"

namespace dtrain::optim::internal {

// bfloat16 state: m, v (and vmax) rounded stochastically (with each slot's salt) or to nearest.
template <typename D, bool kAmsgrad, bool kDecoupled, bool kStochastic, typename Options>
void adam_bf16(const LowPrecisionTensor& t, int64_t lo, int64_t hi, const Options& o) {
  float* __restrict p = t.p;
  const float* __restrict g = t.g;
  auto* __restrict m = static_cast<uint16_t*>(t.s[0]);
  auto* __restrict v = static_cast<uint16_t*>(t.s[1]);
  auto* __restrict vmax = static_cast<uint16_t*>(t.s[2]);
  const uint32_t salt_m = t.salt[0], salt_v = t.salt[1], salt_vmax = t.salt[2];
  const typename D::template Constants<float> c(o, t.c);
  for (int64_t k = lo; k < hi; ++k) {
    float mk = bf16_value(m[k]), vk = bf16_value(v[k]);
    float vmk = kAmsgrad ? bf16_value(vmax[k]) : 0.0f;
    p[k] = D::template element<float, kAmsgrad, kDecoupled>(c, p[k], g[k], mk, vk, vmk);
    m[k] = bf16_bits(mk, kStochastic, kStochastic ? rounding_bits(salt_m, k) : 0);
    v[k] = bf16_bits(vk, kStochastic, kStochastic ? rounding_bits(salt_v, k) : 0);
    if (kAmsgrad)
      vmax[k] = bf16_bits(vmk, kStochastic, kStochastic ? rounding_bits(salt_vmax, k) : 0);
  }
}

// The block's values re-encoded: absmax as quantize8 takes it, then each value's code.
inline void encode_block(const float* values, int64_t len, const Encoder8& enc, uint8_t* codes,
                         float* absmax) {
  float a = 0;
  for (int64_t j = 0; j < len; ++j) a = std::max(a, std::fabs(values[j]));
  a = std::max(a, kMinAbsmax);
  *absmax = a;
  for (int64_t j = 0; j < len; ++j) codes[j] = enc.encode_fast(values[j] / a);
}

// 8-bit state, [lo, hi) block-aligned.
template <typename D, bool kAmsgrad, bool kDecoupled, typename Options>
void adam_8bit(const LowPrecisionTensor& t, int64_t lo, int64_t hi, const Options& o) {
  const Encoder8& signed_enc = Encoder8::get(true);
  const Encoder8& unsigned_enc = Encoder8::get(false);
  auto* m = static_cast<uint8_t*>(t.s[0]);
  auto* v = static_cast<uint8_t*>(t.s[1]);
  auto* vmax = static_cast<uint8_t*>(t.s[2]);
  const typename D::template Constants<float> c(o, t.c);
  float mb[kQuantBlock], vb[kQuantBlock], vmb[kQuantBlock];
  for (int64_t b0 = lo; b0 < hi; b0 += kQuantBlock) {
    const int64_t b = b0 / kQuantBlock, len = std::min(hi - b0, kQuantBlock);
    const float am = t.absmax[0][b], av = t.absmax[1][b];
    const float avm = kAmsgrad ? t.absmax[2][b] : 0.0f;
    for (int64_t j = 0; j < len; ++j) {
      mb[j] = signed_enc.decode(m[b0 + j]) * am;
      vb[j] = unsigned_enc.decode(v[b0 + j]) * av;
      vmb[j] = kAmsgrad ? unsigned_enc.decode(vmax[b0 + j]) * avm : 0.0f;
    }
    for (int64_t j = 0; j < len; ++j) {
      const int64_t k = b0 + j;
      t.p[k] =
          D::template element<float, kAmsgrad, kDecoupled>(c, t.p[k], t.g[k], mb[j], vb[j], vmb[j]);
    }
    encode_block(mb, len, signed_enc, m + b0, &t.absmax[0][b]);
    encode_block(vb, len, unsigned_enc, v + b0, &t.absmax[1][b]);
    if (kAmsgrad) encode_block(vmb, len, unsigned_enc, vmax + b0, &t.absmax[2][b]);
  }
}

template <typename D, bool kAmsgrad, bool kDecoupled, typename Options>
void adam_low_precision_typed(const LowPrecisionTensor& t, int64_t lo, int64_t hi, const Options& o,
                              const StatePrecision& precision) {
  if (precision.dtype == StateDtype::k8Bit) {
    adam_8bit<D, kAmsgrad, kDecoupled>(t, lo, hi, o);
  } else {
    if (precision.stochastic) return adam_bf16<D, kAmsgrad, kDecoupled, true>(t, lo, hi, o);
    adam_bf16<D, kAmsgrad, kDecoupled, false>(t, lo, hi, o);
  }
}

template <typename D, typename Options>
void adam_low_precision_any(const LowPrecisionTensor& t, int64_t lo, int64_t hi, const Options& o,
                            const StatePrecision& precision, bool decoupled) {
  if (decoupled) {
    return o.amsgrad() ? adam_low_precision_typed<D, true, true>(t, lo, hi, o, precision)
                       : adam_low_precision_typed<D, false, true>(t, lo, hi, o, precision);
  }
  return o.amsgrad() ? adam_low_precision_typed<D, true, false>(t, lo, hi, o, precision)
                     : adam_low_precision_typed<D, false, false>(t, lo, hi, o, precision);
}

// The same, built for AVX2 (see kernel_avx2 in internal/optimizer_impl.h: bit-identical).
template <typename D, typename Options>
__attribute__((target("avx2"), flatten)) void adam_low_precision_avx2(
    const LowPrecisionTensor& t, int64_t lo, int64_t hi, const Options& o,
    const StatePrecision& precision, bool decoupled) {
  adam_low_precision_any<D>(t, lo, hi, o, precision, decoupled);
}

template <typename D, typename Options>
void adam_low_precision(KernelIsa isa, const LowPrecisionTensor& t, int64_t lo, int64_t hi,
                        const Options& o, const StatePrecision& precision, bool decoupled) {
  if (isa == KernelIsa::kAvx2)
    return adam_low_precision_avx2<D>(t, lo, hi, o, precision, decoupled);
  adam_low_precision_any<D>(t, lo, hi, o, precision, decoupled);
}

}  // namespace dtrain::optim::internal

#endif  // DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_ADAM_LOW_PRECISION_H_
