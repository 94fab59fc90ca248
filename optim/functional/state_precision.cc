#include "optim/functional/state_precision.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

namespace dtrain::optim {

StatePrecision parse_state_precision(const std::string& optimizer,
                                     const std::optional<std::string>& state_dtype,
                                     bool stochastic_rounding, int64_t seed, bool allow_8bit) {
  StatePrecision p;
  p.stochastic = stochastic_rounding;
  p.seed = seed;
  if (state_dtype.has_value()) {
    if (*state_dtype == kStateBFloat16) {
      p.dtype = StateDtype::kBFloat16;
    } else if (*state_dtype == kState8Bit) {
      TORCH_CHECK(allow_8bit, optimizer,
                  ": state_dtype='8bit' is for the Adam family (Adam, AdamW); ", optimizer,
                  " keeps its state in the parameter's dtype (None) or in 'bfloat16'");
      p.dtype = StateDtype::k8Bit;
    } else {
      TORCH_CHECK(false, optimizer, ": state_dtype='", *state_dtype,
                  "' is not a state precision; use None (the parameter's dtype), 'bfloat16'",
                  allow_8bit ? " or '8bit'" : "");
    }
  }
  TORCH_CHECK(seed >= 0, optimizer, ": state_seed=", seed,
              " is negative; use a seed in [0, 2^63) (it keys stochastic rounding)");
  return p;
}

std::string state_dtype_repr(StateDtype dtype) {
  switch (dtype) {
    case StateDtype::kParam:
      return "None";
    case StateDtype::kBFloat16:
      return std::string("'") + kStateBFloat16 + "'";
    case StateDtype::k8Bit:
      return std::string("'") + kState8Bit + "'";
  }
  return "?";
}

namespace {

// bitsandbytes' dynamic map with 7 exponent bits, as torchao builds it: for each decade
// 10^(i-6), i = 0..6, the midpoints of an even split of [0.1, 1] into 2^i (signed, each with its
// negative) or 2^(i+1) (unsigned) parts, scaled by the decade; then 0 and 1. Computed in double,
// rounded once to float (torchao computes the split in float32: the entries agree to an ulp).
std::array<float, 256> make_dynamic_map(bool is_signed) {
  std::vector<double> data;
  for (int i = 0; i < 7; ++i) {
    const int parts = is_signed ? (1 << i) : (1 << (i + 1));
    const double decade = std::pow(10.0, i - 6);
    for (int k = 0; k < parts; ++k) {
      const double lo = 0.1 + 0.9 * k / parts, hi = 0.1 + 0.9 * (k + 1) / parts;
      const double mean = (lo + hi) / 2 * decade;
      data.push_back(mean);
      if (is_signed) data.push_back(-mean);
    }
  }
  data.push_back(0.0);
  data.push_back(1.0);
  TORCH_INTERNAL_ASSERT(data.size() == 256);
  std::sort(data.begin(), data.end());
  std::array<float, 256> map{};
  for (size_t k = 0; k < 256; ++k) map[k] = static_cast<float>(data[k]);
  return map;
}

// Floats in value order: a key that increases with the value (NaNs aside).
uint32_t ordered_key(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
float from_ordered_key(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace

const std::array<float, 256>& dynamic_map(bool is_signed) {
  static const std::array<float, 256> kSigned = make_dynamic_map(true);
  static const std::array<float, 256> kUnsigned = make_dynamic_map(false);
  return is_signed ? kSigned : kUnsigned;
}

uint8_t encode8_reference(float u, bool is_signed) {
  const std::array<float, 256>& map = dynamic_map(is_signed);
  unsigned c = 0;
  for (unsigned step = 128; step >= 1; step /= 2) {
    if (u >= map[c + step]) c += step;
    if (step == 1) break;
  }
  const unsigned up = std::min(c + 1, 255u);
  const float down = map[c];
  if (u - down >= (map[up] - down) * 0.5f) c = up;
  return static_cast<uint8_t>(c);
}

Encoder8::Encoder8(bool is_signed) : map_(dynamic_map(is_signed)) {
  // threshold_[c]: the first float (in value order, from -2 to 2) whose reference code exceeds c;
  // the reference code is non-decreasing in u, so a bisection over the ordered keys finds it.
  const uint32_t lowest = ordered_key(-2.0f), highest = ordered_key(2.0f);
  for (unsigned c = 0; c < 256; ++c) {
    uint32_t lo = lowest, hi = highest;  // code(lo) <= c < code(hi) for c < 255
    if (c == 255 || encode8_reference(from_ordered_key(hi), is_signed) <= c) {
      threshold_[c] = INFINITY;
      continue;
    }
    while (hi - lo > 1) {
      const uint32_t mid = lo + (hi - lo) / 2;
      if (encode8_reference(from_ordered_key(mid), is_signed) > c) {
        hi = mid;
      } else {
        lo = mid;
      }
    }
    threshold_[c] = from_ordered_key(hi);
  }
  // table_[h]: the code of the lowest value whose top 16 bits are h (the most negative one for
  // negative buckets); encode() then counts the thresholds at or below u from there.
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint32_t bits = (h & 0x8000u) ? ((h << 16) | 0xffffu) : (h << 16);
    float lowest_value;
    std::memcpy(&lowest_value, &bits, sizeof lowest_value);
    table_[h] = std::isnan(lowest_value) ? 0 : encode8_reference(lowest_value, is_signed);
  }
  fill_buckets(is_signed);
}

void Encoder8::fill_buckets(bool is_signed) {
  auto code = [&](uint32_t bits) {
    float u;
    std::memcpy(&u, &bits, sizeof u);
    return static_cast<uint32_t>(encode8_reference(u, is_signed));
  };
  for (uint32_t sign = 0; sign < 2; ++sign) {
    const uint32_t s = sign << 31;
    // Row 0 (below 2^-24) and the last row (1 and above, infinity included): one code each.
    const uint32_t low = code(s), high = code(s | 0x7f800000u);
    TORCH_INTERNAL_ASSERT(code(s | ((kLowExponent << 23) - 1)) == low &&
                          code(s | 0x3f800000u) == high);
    for (uint32_t m = 0; m < 128; ++m) {
      buckets_[sign * kRows * 128 + m] = (low << 17) | 0x10000u;
      buckets_[sign * kRows * 128 + (kRows - 1) * 128 + m] = (high << 17) | 0x10000u;
    }
    for (uint32_t e = kLowExponent; e < 127; ++e) {
      for (uint32_t m = 0; m < 128; ++m) {
        const uint32_t top = s | (e << 23) | (m << 16);
        const uint32_t lowest = sign ? (top | 0xffffu) : top,
                       highest = sign ? top : (top | 0xffffu);
        const uint32_t c = code(lowest), step = code(highest) - c;
        TORCH_INTERNAL_ASSERT(step <= 1, "Encoder8: two code steps in one bucket");
        uint32_t key = 0x10000u;
        if (step == 1) {
          uint32_t t;
          std::memcpy(&t, &threshold_[c], sizeof t);
          TORCH_INTERNAL_ASSERT((t & 0xffff0000u) == top);
          key = bucket_key(t);
        }
        buckets_[bucket(top)] = (c << 17) | key;
      }
    }
  }
}

const Encoder8& Encoder8::get(bool is_signed) {
  static const Encoder8* kSigned = new Encoder8(true);
  static const Encoder8* kUnsigned = new Encoder8(false);
  return is_signed ? *kSigned : *kUnsigned;
}

uint64_t rounding_key(int64_t seed, int64_t step, uint64_t param_index, size_t slot) {
  uint64_t k = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ULL;
  k ^= static_cast<uint64_t>(step) * 0xD1B54A32D192ED03ULL;
  k ^= param_index * 0xAEF17502108EF2D9ULL;
  k ^= static_cast<uint64_t>(slot / 2 + 1) * 0x94D049BB133111EBULL;
  return (k & ~uint64_t{1}) | (slot & 1u);  // bit 0: the slot's half of the pair's hash
}

namespace {

// rounding_bits as ATen operations over element indices (devices other than the CPU).
at::Tensor rounding_bits_aten(uint32_t salt, unsigned shift, int64_t n,
                              const at::TensorOptions& options) {
  const int64_t mask = 0xffffffffLL;
  at::Tensor x = at::arange(n, options.dtype(at::kLong));
  x = at::bitwise_xor(at::bitwise_and(x, mask), static_cast<int64_t>(salt));
  x = at::bitwise_xor(x, at::bitwise_right_shift(x, 16));
  x = at::bitwise_and(x.mul(static_cast<int64_t>(0x7feb352du)), mask);
  x = at::bitwise_xor(x, at::bitwise_right_shift(x, 15));
  x = at::bitwise_and(x.mul(static_cast<int64_t>(0x846ca68bu)), mask);
  x = at::bitwise_xor(x, at::bitwise_right_shift(x, 16));
  return at::bitwise_and(at::bitwise_right_shift(x, static_cast<int64_t>(shift)), 0xffff);
}

}  // namespace

namespace internal {

at::Tensor to_bfloat16_aten(const at::Tensor& x, bool stochastic, uint64_t key) {
  const at::Tensor f = x.to(at::kFloat).contiguous();
  const int64_t n = f.numel();
  at::Tensor bits = at::bitwise_and(f.view(at::kInt).reshape({n}).to(at::kLong), 0xffffffffLL);
  at::Tensor add = stochastic
                       ? rounding_bits_aten(rounding_salt(key), rounding_shift(key), n, f.options())
                       : at::bitwise_and(at::bitwise_right_shift(bits, 16), 1).add(0x7fff);
  at::Tensor upper = at::bitwise_and(at::bitwise_right_shift(bits.add(add), 16), 0xffff);
  upper = at::where(f.reshape({n}).isnan(), at::full({}, 0x7fc0, upper.options()), upper);
  // The 16-bit patterns as int16 (two's complement), then read as bfloat16.
  upper = at::where(upper.ge(0x8000), upper.sub(0x10000), upper);
  return upper.to(at::kShort).view(at::kBFloat16).reshape(x.sizes());
}

}  // namespace internal

at::Tensor to_bfloat16(const at::Tensor& x, bool stochastic, uint64_t key) {
  if (!x.is_cpu()) return internal::to_bfloat16_aten(x, stochastic, key);
  const at::Tensor f = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const float* in = f.data_ptr<float>();
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const uint32_t salt = rounding_salt(key);
  const unsigned shift = rounding_shift(key);
  at::parallel_for(0, f.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      o[k] = bf16_bits(in[k], stochastic, stochastic ? rounding_bits(salt, shift, k) : 0);
    }
  });
  return out;
}

at::Tensor master_weight(const at::Tensor& param, const at::Tensor& remainder) {
  TORCH_CHECK(param.scalar_type() == at::kBFloat16 && remainder.scalar_type() == at::kShort &&
                  param.sizes().equals(remainder.sizes()),
              "master_weight: takes a bfloat16 parameter and an int16 remainder of its shape, got ",
              param.scalar_type(), " ", param.sizes(), " and ", remainder.scalar_type(), " ",
              remainder.sizes());
  if (!param.is_cpu() || !param.is_contiguous() || !remainder.is_contiguous()) {
    const at::Tensor rem = remainder.to(at::kInt);
    const at::Tensor high = param.view(at::kShort).to(at::kInt) - rem.lt(0).to(at::kInt);
    return high.bitwise_left_shift(16).bitwise_or(rem.bitwise_and(0xffff)).view(at::kFloat);
  }
  at::Tensor out = at::empty(param.sizes(), param.options().dtype(at::kFloat));
  const auto* p = reinterpret_cast<const uint16_t*>(param.data_ptr<at::BFloat16>());
  const int16_t* r = remainder.data_ptr<int16_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, param.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) o[k] = join_master(p[k], r[k]);
  });
  return out;
}

void split_master_weight(const at::Tensor& master, const at::Tensor& param,
                         const at::Tensor& remainder) {
  TORCH_CHECK(master.scalar_type() == at::kFloat && param.scalar_type() == at::kBFloat16 &&
                  remainder.scalar_type() == at::kShort && master.sizes().equals(param.sizes()) &&
                  remainder.sizes().equals(param.sizes()),
              "split_master_weight: takes a float32 master, a bfloat16 parameter and an int16 "
              "remainder of one shape, got ",
              master.scalar_type(), " ", master.sizes(), ", ", param.scalar_type(), " ",
              param.sizes(), " and ", remainder.scalar_type(), " ", remainder.sizes());
  if (!param.is_cpu() || !master.is_contiguous() || !param.is_contiguous() ||
      !remainder.is_contiguous()) {
    const at::Tensor bits = master.contiguous().view(at::kInt);
    const at::Tensor low = bits.bitwise_and(0xffff);
    const at::Tensor nan = master.isnan();
    at::Tensor high =
        bits.bitwise_right_shift(16).bitwise_and(0xffff) + low.ge(0x8000).to(at::kInt);
    high = at::where(nan, bits.lt(0).to(at::kInt) * 0x8000 + 0x7fc0, high);
    param.copy_(high.to(at::kShort).view(at::kBFloat16));  // int32 -> int16 keeps the low bits
    remainder.copy_(at::where(nan, at::zeros_like(low), low).to(at::kShort));
    return;
  }
  const float* m = master.data_ptr<float>();
  auto* p = reinterpret_cast<uint16_t*>(param.data_ptr<at::BFloat16>());
  int16_t* r = remainder.data_ptr<int16_t>();
  at::parallel_for(0, master.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) split_master(m[k], &p[k], &r[k]);
  });
}

namespace internal {

Quantized8 quantize8_aten(const at::Tensor& x, bool is_signed) {
  const int64_t n = x.numel(), blocks = quant_blocks(n);
  at::Tensor flat = x.to(at::kFloat).reshape({n});
  at::Tensor padded = at::zeros({blocks * kQuantBlock}, flat.options());
  padded.narrow(0, 0, n).copy_(flat);
  at::Tensor rows = padded.view({blocks, kQuantBlock});
  at::Tensor absmax = rows.abs().amax(1).clamp_min(kMinAbsmax);
  at::Tensor u = rows / absmax.unsqueeze(1);
  const std::array<float, 256>& m = dynamic_map(is_signed);
  at::Tensor map = at::tensor(at::ArrayRef<float>(m.data(), m.size()), flat.options());
  at::Tensor codes =
      at::searchsorted(map, u, /*out_int32=*/false, /*right=*/true).sub(1).clamp_(0, 255);
  at::Tensor up = codes.add(1).clamp_max(255);
  at::Tensor down = map.index({codes});
  at::Tensor round_up = (u - down).ge((map.index({up}) - down) * 0.5);
  codes = at::where(round_up, up, codes);
  return {codes.reshape({blocks * kQuantBlock}).narrow(0, 0, n).to(at::kByte).reshape(x.sizes()),
          absmax};
}

}  // namespace internal

Quantized8 quantize8(const at::Tensor& x, bool is_signed) {
  if (!x.is_cpu()) return internal::quantize8_aten(x, is_signed);
  const at::Tensor f = x.to(at::kFloat).contiguous();
  const int64_t n = f.numel(), blocks = quant_blocks(n);
  Quantized8 q{at::empty(x.sizes(), x.options().dtype(at::kByte)),
               at::empty({blocks}, x.options().dtype(at::kFloat))};
  const float* in = f.data_ptr<float>();
  uint8_t* codes = q.codes.data_ptr<uint8_t>();
  float* absmax = q.absmax.data_ptr<float>();
  const Encoder8& enc = Encoder8::get(is_signed);
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kQuantBlock, hi = std::min(n, lo + kQuantBlock);
      float a = 0;
      for (int64_t k = lo; k < hi; ++k) a = std::max(a, std::fabs(in[k]));
      a = std::max(a, kMinAbsmax);
      absmax[b] = a;
      for (int64_t k = lo; k < hi; ++k) codes[k] = enc.encode_fast(in[k] / a);
    }
  });
  return q;
}

at::Tensor dequantize8(const Quantized8& q, bool is_signed, at::ScalarType dtype) {
  const int64_t n = q.codes.numel();
  TORCH_CHECK(q.absmax.numel() == quant_blocks(n), "dequantize8: ", q.absmax.numel(),
              " scales for ", n, " codes; an 8-bit slot has one per block of ", kQuantBlock);
  const std::array<float, 256>& m = dynamic_map(is_signed);
  at::Tensor map =
      at::tensor(at::ArrayRef<float>(m.data(), m.size()), q.absmax.options().dtype(at::kFloat));
  at::Tensor values = map.index({q.codes.reshape({n}).to(at::kLong)});
  at::Tensor scale = q.absmax.to(at::kFloat).repeat_interleave(kQuantBlock).narrow(0, 0, n);
  return (values * scale).reshape(q.codes.sizes()).to(dtype);
}

at::Tensor slot_values(const at::Tensor& slot, const at::Tensor& scales, bool is_signed,
                       at::ScalarType dtype) {
  if (scales.defined()) return dequantize8({slot, scales}, is_signed, dtype);
  return slot.scalar_type() == dtype ? slot : slot.to(dtype);
}

void store_slot(const at::Tensor& values, const StatePrecision& precision, bool is_signed,
                uint64_t key, at::ScalarType param_dtype, at::Tensor* slot, at::Tensor* scales) {
  switch (precision.dtype) {
    case StateDtype::kParam:
      *slot = values.scalar_type() == param_dtype ? values : values.to(param_dtype);
      *scales = at::Tensor();
      return;
    case StateDtype::kBFloat16:
      *slot = values.scalar_type() == at::kBFloat16
                  ? values
                  : to_bfloat16(values, precision.stochastic, key);
      *scales = at::Tensor();
      return;
    case StateDtype::k8Bit: {
      Quantized8 q = quantize8(values, is_signed);
      *slot = std::move(q.codes);
      *scales = std::move(q.absmax);
      return;
    }
  }
}

bool slot_is_stored_as(const at::Tensor& slot, const at::Tensor& scales,
                       const StatePrecision& precision, at::ScalarType param_dtype) {
  switch (precision.dtype) {
    case StateDtype::kParam:
      return !scales.defined() && slot.scalar_type() == param_dtype;
    case StateDtype::kBFloat16:
      return !scales.defined() && slot.scalar_type() == at::kBFloat16;
    case StateDtype::k8Bit:
      return scales.defined() && slot.scalar_type() == at::kByte;
  }
  return false;
}

}  // namespace dtrain::optim
