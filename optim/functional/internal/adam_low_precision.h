// Adam's and AdamW's fused CPU kernels for state kept in bfloat16 or 8 bits: each element's
// update is the float kernel's (AdamDescriptor::element, float32 registers), read from and
// written back to the narrow state in place; 8-bit blocks of kQuantBlock elements are decoded,
// updated and re-encoded one at a time (internal/quant8_block.h: AVX2 gathers in the AVX2 build,
// AVX-512 VBMI byte look-ups for decoding in the AVX-512 build where the CPU has them),
// so no float copy of the state exists. With param_remainders (internal/param_remainders.h) they
// also take float32 state, beside a bfloat16 parameter and its remainder. Internal to optim/.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_ADAM_LOW_PRECISION_H_
#define DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_ADAM_LOW_PRECISION_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "optim/functional/internal/fused.h"
#include "optim/functional/internal/low_precision.h"
#include "optim/functional/internal/quant8_block.h"
#include "optim/functional/state_precision.h"

namespace dtrain::optim::internal {

// State of type S: bfloat16 bits (uint16_t) rounded stochastically or to nearest, or float32 (only
// with param_remainders: float32 state beside a bfloat16 parameter). For bfloat16, m and v take the
// two halves of one hash per element (their salts are equal: rounding_key's slot pair), vmax the
// low half of its own.
template <typename S>
inline float slot_value(S x) {
  if constexpr (std::is_same_v<S, float>) {
    return x;
  } else {
    return bf16_value(x);
  }
}
template <typename S>
inline S slot_store(float x, bool stochastic, uint32_t random16) {
  if constexpr (std::is_same_v<S, float>) {
    return x;
  } else {
    return bf16_bits(x, stochastic, random16);
  }
}

template <typename D, typename S, bool kAmsgrad, bool kDecoupled, bool kStochastic,
          bool kRemainders, typename Options>
void adam_elementwise(const LowPrecisionTensor& t, int64_t lo, int64_t hi, const Options& o) {
  const ParamAccess<kRemainders> pa(t);
  auto* __restrict m = static_cast<S*>(t.s[0]);
  auto* __restrict v = static_cast<S*>(t.s[1]);
  auto* __restrict vmax = static_cast<S*>(t.s[2]);
  const uint32_t salt_mv = t.salt[0], salt_vmax = t.salt[2];
  const typename D::template Constants<float> c(o, t.c);
  for (int64_t k = lo; k < hi; ++k) {
    float mk = slot_value(m[k]), vk = slot_value(v[k]);
    float vmk = kAmsgrad ? slot_value(vmax[k]) : 0.0f;
    pa.store(k, D::template element<float, kAmsgrad, kDecoupled>(c, pa.param(k), pa.grad(k), mk, vk,
                                                                 vmk));
    const uint32_t r = kStochastic ? rounding_hash(salt_mv, k) : 0;
    m[k] = slot_store<S>(mk, kStochastic, r & 0xFFFFu);
    v[k] = slot_store<S>(vk, kStochastic, r >> 16);
    if (kAmsgrad)
      vmax[k] = slot_store<S>(vmk, kStochastic, kStochastic ? rounding_bits(salt_vmax, 0, k) : 0);
  }
}

// 8-bit state, [lo, hi) block-aligned: each block's slots decoded into float buffers, updated,
// and re-encoded (Quant8Block: the ISA's lanes, quantize8's bits).
template <typename D, bool kAmsgrad, bool kDecoupled, KernelIsa kIsa, bool kRemainders,
          typename Options>
void adam_8bit(const LowPrecisionTensor& t, int64_t lo, int64_t hi, const Options& o) {
  using Q = Quant8Block<kIsa>;
  const Encoder8& signed_enc = Encoder8::get(true);
  const Encoder8& unsigned_enc = Encoder8::get(false);
  auto* m = static_cast<uint8_t*>(t.s[0]);
  auto* v = static_cast<uint8_t*>(t.s[1]);
  auto* vmax = static_cast<uint8_t*>(t.s[2]);
  const ParamAccess<kRemainders> pa(t);
  const typename D::template Constants<float> c(o, t.c);
  alignas(64) float mb[kQuantBlock], vb[kQuantBlock], vmb[kQuantBlock];
  for (int64_t b0 = lo; b0 < hi; b0 += kQuantBlock) {
    const int64_t b = b0 / kQuantBlock, len = std::min(hi - b0, kQuantBlock);
    Q::decode(m + b0, len, signed_enc, t.absmax[0][b], mb);
    Q::decode(v + b0, len, unsigned_enc, t.absmax[1][b], vb);
    if (kAmsgrad) Q::decode(vmax + b0, len, unsigned_enc, t.absmax[2][b], vmb);
    float* __restrict mr = mb;
    float* __restrict vr = vb;
    float* __restrict vmr = vmb;
    for (int64_t j = 0; j < len; ++j) {
      float vmj = kAmsgrad ? vmr[j] : 0.0f;
      pa.store(b0 + j, D::template element<float, kAmsgrad, kDecoupled>(
                           c, pa.param(b0 + j), pa.grad(b0 + j), mr[j], vr[j], vmj));
      if (kAmsgrad) vmr[j] = vmj;
    }
    t.absmax[0][b] = Q::encode(mb, len, signed_enc, m + b0);
    t.absmax[1][b] = Q::encode(vb, len, unsigned_enc, v + b0);
    if (kAmsgrad) t.absmax[2][b] = Q::encode(vmb, len, unsigned_enc, vmax + b0);
  }
}

template <typename D, bool kAmsgrad, bool kDecoupled, KernelIsa kIsa, bool kRemainders,
          typename Options>
void adam_low_precision_typed(const LowPrecisionTensor& t, int64_t lo, int64_t hi, const Options& o,
                              const StatePrecision& precision) {
  if (precision.dtype == StateDtype::k8Bit) {
    adam_8bit<D, kAmsgrad, kDecoupled, kIsa, kRemainders>(t, lo, hi, o);
  } else if (precision.dtype == StateDtype::kParam) {
    if constexpr (kRemainders) {  // float32 state beside param_remainders' master
      adam_elementwise<D, float, kAmsgrad, kDecoupled, false, true>(t, lo, hi, o);
    }
  } else if (precision.stochastic) {
    adam_elementwise<D, uint16_t, kAmsgrad, kDecoupled, true, kRemainders>(t, lo, hi, o);
  } else {
    adam_elementwise<D, uint16_t, kAmsgrad, kDecoupled, false, kRemainders>(t, lo, hi, o);
  }
}

template <typename D, bool kAmsgrad, bool kDecoupled, KernelIsa kIsa, typename Options>
void adam_low_precision_param(const LowPrecisionTensor& t, int64_t lo, int64_t hi, const Options& o,
                              const StatePrecision& precision) {
  if (t.pb != nullptr) {
    return adam_low_precision_typed<D, kAmsgrad, kDecoupled, kIsa, true>(t, lo, hi, o, precision);
  }
  adam_low_precision_typed<D, kAmsgrad, kDecoupled, kIsa, false>(t, lo, hi, o, precision);
}

template <typename D, KernelIsa kIsa, typename Options>
void adam_low_precision_any(const LowPrecisionTensor& t, int64_t lo, int64_t hi, const Options& o,
                            const StatePrecision& precision, bool decoupled) {
  if (decoupled) {
    return o.amsgrad() ? adam_low_precision_param<D, true, true, kIsa>(t, lo, hi, o, precision)
                       : adam_low_precision_param<D, false, true, kIsa>(t, lo, hi, o, precision);
  }
  return o.amsgrad() ? adam_low_precision_param<D, true, false, kIsa>(t, lo, hi, o, precision)
                     : adam_low_precision_param<D, false, false, kIsa>(t, lo, hi, o, precision);
}

// The same, built for AVX2 and for AVX-512 (see kernel_avx2 in internal/optimizer_impl.h and
// KernelIsa in internal/fused.h: bit-identical).
template <typename D, typename Options>
__attribute__((target("avx2"), flatten)) void adam_low_precision_avx2(
    const LowPrecisionTensor& t, int64_t lo, int64_t hi, const Options& o,
    const StatePrecision& precision, bool decoupled) {
  adam_low_precision_any<D, KernelIsa::kAvx2>(t, lo, hi, o, precision, decoupled);
}
template <typename D, typename Options>
__attribute__((target(DTRAIN_AVX512_TARGET), flatten)) void adam_low_precision_avx512(
    const LowPrecisionTensor& t, int64_t lo, int64_t hi, const Options& o,
    const StatePrecision& precision, bool decoupled) {
  adam_low_precision_any<D, KernelIsa::kAvx512>(t, lo, hi, o, precision, decoupled);
}

template <typename D, typename Options>
void adam_low_precision(KernelIsa isa, const LowPrecisionTensor& t, int64_t lo, int64_t hi,
                        const Options& o, const StatePrecision& precision, bool decoupled) {
  if (isa == KernelIsa::kAvx512)
    return adam_low_precision_avx512<D>(t, lo, hi, o, precision, decoupled);
  if (isa == KernelIsa::kAvx2)
    return adam_low_precision_avx2<D>(t, lo, hi, o, precision, decoupled);
  adam_low_precision_any<D, KernelIsa::kBaseline>(t, lo, hi, o, precision, decoupled);
}

}  // namespace dtrain::optim::internal

#endif  // DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_ADAM_LOW_PRECISION_H_
