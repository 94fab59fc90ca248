// Optimizer state in fewer bytes: the three state precisions a functional optimizer keeps its
// slots (exp_avg, exp_avg_sq, momentum_buffer, ...) in, and the conversions between them. The
// update itself always runs in float32 registers (or the parameter's dtype, when wider); only
// what stays in memory between steps is narrower.
//
//   state_dtype=None (the default)  the parameter's dtype: PyTorch's behaviour, bit for bit.
//   state_dtype="bfloat16"          2 bytes per element. Rounded stochastically (the default:
//                                   state_stochastic_rounding=True) with counter-based random bits
//                                   keyed by (state_seed, step, parameter, slot, element): 16 bits
//                                   of a 32-bit hash of the element per pair of slots; so a run is
//                                   reproducible and resumes bit for bit with no generator
//                                   state to save; or to nearest (False), which biases an EMA of
//                                   small increments (Adam's exp_avg_sq) towards its past.
//   state_dtype="8bit"              1 byte per element + one float32 scale per block of 256:
//                                   torchao's AdamW8bit / bitsandbytes' blockwise dynamic
//                                   quantisation (arXiv 2110.02861): scale = max|x| of the block
//                                   (at least 1e-12), code = the nearest entry of the 256-entry
//                                   dynamic map (signed for exp_avg, unsigned for second moments)
//                                   to x / scale, ties upwards, exactly as torchao's
//                                   quantize_8bit_with_qmap. The Adam family only (Adam, AdamW).
//
//   dtrain::optim::FunctionalAdamW adamw(params, AdamWOptions().lr(3e-4).state_dtype("8bit"));
//   at::Tensor v16 = dtrain::optim::to_bfloat16(v, /*stochastic=*/true, key);   // one slot
//   dtrain::optim::Quantized8 q = dtrain::optim::quantize8(m, /*is_signed=*/true);
//   at::Tensor m32 = dtrain::optim::dequantize8(q, /*is_signed=*/true, at::kFloat);
//
// State dicts: bfloat16 slots are written as bfloat16 tensors under PyTorch's keys (PyTorch's
// load_state_dict casts them to the parameter's dtype); 8-bit slots as `<slot>_codes` (uint8,
// the slot's shape) and `<slot>_absmax` (float32, one per block of 256 of the flattened slot), and
// the param group records state_dtype, so a loader that cannot take them stops: PyTorch raises
// KeyError: '<slot>' at its first step, never reading codes as values. dtrain's loaders take any
// precision and convert to their own (bit for bit when they are the same).
// Thread safety: everything here is a pure function or immutable after first use.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_STATE_PRECISION_H_
#define DTRAIN_OPTIM_FUNCTIONAL_STATE_PRECISION_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

namespace dtrain::optim {

enum class StateDtype { kParam, kBFloat16, k8Bit };

// The option keys (in every built-in optimizer's param group when state_dtype is not None).
inline constexpr char kStateDtypeKey[] = "state_dtype";
inline constexpr char kStateStochasticRoundingKey[] = "state_stochastic_rounding";
inline constexpr char kStateSeedKey[] = "state_seed";
// The option values of state_dtype.
inline constexpr char kStateBFloat16[] = "bfloat16";
inline constexpr char kState8Bit[] = "8bit";
// Adam's and AdamW's param_remainders option and its state key (an int16 tensor of the
// parameter's shape): see split_master below.
inline constexpr char kParamRemaindersKey[] = "param_remainders";
inline constexpr char kParamRemainderKey[] = "param_remainder";
// Whether `key` is one of dtrain's own options (the state-precision keys, param_remainders): a
// loaded param group without it (PyTorch's) keeps the loading optimizer's value.
inline bool is_dtrain_option(const std::string& key) {
  return key == kStateDtypeKey || key == kStateStochasticRoundingKey || key == kStateSeedKey ||
         key == kParamRemaindersKey;
}

// The state-dict keys of an 8-bit slot: "<slot>_codes" and "<slot>_absmax".
inline constexpr char kCodesSuffix[] = "_codes";
inline constexpr char kAbsmaxSuffix[] = "_absmax";

struct StatePrecision {
  StateDtype dtype = StateDtype::kParam;
  bool stochastic = true;  // bfloat16 only
  int64_t seed = 0;
};

// Parses the three options; TORCH_CHECK naming the value and the choices on a bad state_dtype or a
// negative seed. `optimizer` names it; `allow_8bit`: whether this optimizer has 8-bit state.
StatePrecision parse_state_precision(const std::string& optimizer,
                                     const std::optional<std::string>& state_dtype,
                                     bool stochastic_rounding, int64_t seed, bool allow_8bit);

// "None", "'bfloat16'", "'8bit'": for messages.
std::string state_dtype_repr(StateDtype dtype);

// Elements per 8-bit block (torchao's and bitsandbytes' default).
inline constexpr int64_t kQuantBlock = 256;
inline int64_t quant_blocks(int64_t numel) { return (numel + kQuantBlock - 1) / kQuantBlock; }
// The smallest scale a block takes (torchao's clip(1e-12)): an all-zero block stays all zero.
inline constexpr float kMinAbsmax = 1e-12f;

// The 256-entry dynamic quantisation map, ascending (torchao's create_dynamic_map(signed),
// bitsandbytes' create_dynamic_map with 7 exponent bits): the signed one spans [-0.993, 1],
// the unsigned one [0, 1].
const std::array<float, 256>& dynamic_map(bool is_signed);

// The code of a normalised value u (x / scale): the nearest map entry, ties upwards, as torchao's
// quantize_8bit_with_qmap computes it (a branchless binary search, then the rounding step).
// encode8_reference is that algorithm; Encoder8 gives the same code (shown equal in the test)
// through a 64 Ki-entry table on the float's top 16 bits and at most a few threshold compares
// (encode), or through its bucket table (encode_fast, and the vectorised kernels, which gather
// from buckets()): 26 exponent rows x 128 mantissa buckets per sign, one 32-bit entry each.
uint8_t encode8_reference(float u, bool is_signed);
class Encoder8 {
 public:
  static const Encoder8& get(bool is_signed);
  uint8_t encode(float u) const {
    uint32_t bits;
    std::memcpy(&bits, &u, sizeof bits);
    unsigned c = table_[bits >> 16];
    while (c < 255 && u >= threshold_[c]) ++c;
    return static_cast<uint8_t>(c);
  }
  // The bucket of u's bits: its sign, its exponent row (exponents below kLowExponent share row 0,
  // where both maps give every value the code of 0; exponents of 1 and above share the last row,
  // where they give the code of +-1) and its top 7 mantissa bits. A bucket's entry holds the code of
  // its lowest value (bits 17..24) and the 16-bit key (bucket_key) of the one value in it where the
  // code steps up by one (bits 0..16; 0x10000 for none): checked at construction for both maps.
  static constexpr uint32_t kLowExponent = 103;  // 2^-24
  static constexpr uint32_t kRows = 128 - kLowExponent + 1;
  static constexpr uint32_t kBuckets = 2 * kRows * 128;
  static uint32_t bucket(uint32_t bits) {
    const uint32_t e = (bits >> 23) & 0xffu;
    const uint32_t row = e < kLowExponent ? 0 : std::min(e - kLowExponent + 1, kRows - 1);
    return (bits >> 31) * (kRows * 128) + row * 128 + ((bits >> 16) & 0x7fu);
  }
  // The low 16 bits of u in value order within its bucket (negative values count down).
  static uint32_t bucket_key(uint32_t bits) { return (bits ^ (0u - (bits >> 31))) & 0xffffu; }
  // encode(u) for |u| <= 1 or beyond (NaN: 0), from one bucket entry and one compare.
  uint8_t encode_fast(float u) const {
    uint32_t bits;
    std::memcpy(&bits, &u, sizeof bits);
    const uint32_t entry = buckets_[bucket(bits)];
    const uint32_t c = (entry >> 17) + (bucket_key(bits) >= (entry & 0x1ffffu) ? 1u : 0u);
    return u != u ? 0 : static_cast<uint8_t>(c);
  }
  float decode(uint8_t c) const { return map_[c]; }
  const float* map() const { return map_.data(); }
  const uint32_t* buckets() const { return buckets_.data(); }

 private:
  explicit Encoder8(bool is_signed);
  void fill_buckets(bool is_signed);
  std::array<float, 256> map_;
  std::array<float, 256> threshold_;  // threshold_[c]: the smallest u whose code exceeds c
  std::array<uint8_t, 65536> table_;  // the code of the lowest value of each 16-bit bucket
  std::array<uint32_t, kBuckets> buckets_;
};

// Stochastic rounding's random bits: 16 per element and slot, from a counter-based hash of (key,
// element index), so any split of the elements among threads gives the same result. One 32-bit
// hash per element (lowbias32: two multiplies) serves a pair of slots (0 and 1, 2 and 3): a key's
// bit 0 is the slot's half of it (rounding_shift), its other bits key the hash (rounding_salt),
// so Adam's exp_avg and exp_avg_sq share one hash per element and take its two halves.
uint64_t rounding_key(int64_t seed, int64_t step, uint64_t param_index, size_t slot);
inline uint32_t rounding_salt(uint64_t key) {
  key >>= 1;
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdULL;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ULL;
  key ^= key >> 33;
  return static_cast<uint32_t>(key);
}
inline unsigned rounding_shift(uint64_t key) { return (key & 1u) ? 16u : 0u; }
inline uint32_t rounding_hash(uint32_t salt, int64_t index) {
  uint32_t x = static_cast<uint32_t>(index) ^ salt;
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
inline uint32_t rounding_bits(uint32_t salt, unsigned shift, int64_t index) {
  return (rounding_hash(salt, index) >> shift) & 0xFFFFu;
}

// float32 -> bfloat16 bits: stochastically (the magnitude rounded up with probability equal to
// the dropped 16 bits / 2^16: torchao's _fp32_to_bf16_sr) or to nearest even. NaN stays NaN.
// (Written without branches, as the two below, so that the kernels' loops vectorise.)
inline uint16_t bf16_bits(float x, bool stochastic, uint32_t random16) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = stochastic ? bits + random16 : bits + 0x7fffu + ((bits >> 16) & 1u);
  return nan ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded >> 16);
}
inline float bf16_value(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// bfloat16 parameters with a 16-bit remainder (Adam's and AdamW's param_remainders option:
// Megatron-Core's store_param_remainders, TransformerEngine FusedAdam's scheme, followed as its
// multi_tensor_adam's AdamFunctorMasterParamRemainder does it): the float32 master weight's top 16
// bits, rounded, are the bfloat16 parameter; its low 16 bits, as an int16, are the remainder.
// Split: rem = int16(low 16 bits); bf16 = high 16 bits, plus 1 when rem < 0 (low bits >= 0x8000:
// the magnitude rounded half up, so the parameter is the master rounded to nearest, ties away from
// zero; a finite master above bfloat16's largest value rounds to +-inf and still reconstructs).
// Join: when rem < 0, bf16 bits - 1 first; then (bf16 << 16) | uint16(rem). inf splits exactly
// (low bits 0). NaN, where dtrain differs from TE: TE adds the 1 to a NaN's high half too, so
// the NaN 0x7FFFFFFF shows as the parameter -0.0 (0x7FFF + 1 wraps to 0x8000); dtrain stores a NaN
// master as bfloat16's quiet NaN of its sign (0x7FC0 / 0xFFC0) with remainder 0, so the parameter
// shows the NaN and the master reconstructs as a NaN (its payload is not kept).
inline void split_master(float master, uint16_t* bf16, int16_t* remainder) {
  uint32_t bits;
  std::memcpy(&bits, &master, sizeof bits);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t low = bits & 0xffffu;
  const uint32_t high = (bits >> 16) + (low >> 15);  // + 1 when low >= 0x8000
  *bf16 = static_cast<uint16_t>(nan ? ((bits >> 16) & 0x8000u) | 0x7fc0u : high);
  *remainder = static_cast<int16_t>(nan ? 0u : low);
}
inline float join_master(uint16_t bf16, int16_t remainder) {
  const uint32_t high = static_cast<uint16_t>(bf16 - (static_cast<uint16_t>(remainder) >> 15));
  const uint32_t bits = (high << 16) | static_cast<uint16_t>(remainder);
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
// The float32 master weights of a bfloat16 `param` and its int16 `remainder` (same shape, any
// device): a new contiguous tensor.
at::Tensor master_weight(const at::Tensor& param, const at::Tensor& remainder);
// `master` (float32, param's shape) split into `param` (bfloat16) and `remainder` (int16), in place.
void split_master_weight(const at::Tensor& master, const at::Tensor& param,
                         const at::Tensor& remainder);

// A tensor of any floating dtype and device to bfloat16, rounded as above (`key` from
// rounding_key; ignored when !stochastic). CPU tensors take a loop; others ATen operations with
// the same bits.
at::Tensor to_bfloat16(const at::Tensor& x, bool stochastic, uint64_t key);

// An 8-bit slot: codes of the slot's shape, absmax of quant_blocks(numel) blocks of its
// flattened elements.
struct Quantized8 {
  at::Tensor codes;   // uint8
  at::Tensor absmax;  // float32
};
// `x` (any floating dtype, any device) quantised as above.
Quantized8 quantize8(const at::Tensor& x, bool is_signed);
// The values of `q` in `dtype` (on q's device).
at::Tensor dequantize8(const Quantized8& q, bool is_signed, at::ScalarType dtype);

namespace internal {
// The ATen-operation forms other devices take (public so that tests compare them on the CPU).
at::Tensor to_bfloat16_aten(const at::Tensor& x, bool stochastic, uint64_t key);
Quantized8 quantize8_aten(const at::Tensor& x, bool is_signed);
}  // namespace internal

// A slot as an optimizer keeps it -- `slot` in the parameter's dtype or bfloat16, or the codes of
// an 8-bit slot when `scales` (its absmax) is defined -- as values in `dtype`.
at::Tensor slot_values(const at::Tensor& slot, const at::Tensor& scales, bool is_signed,
                       at::ScalarType dtype);
// `values` kept at `precision` (`param_dtype` for kParam; bfloat16 rounded with `key`; 8-bit)
// into *slot and *scales (undefined unless 8-bit).
void store_slot(const at::Tensor& values, const StatePrecision& precision, bool is_signed,
                uint64_t key, at::ScalarType param_dtype, at::Tensor* slot, at::Tensor* scales);
// Whether (slot, scales) is already kept as `precision` says for a parameter of `param_dtype`.
bool slot_is_stored_as(const at::Tensor& slot, const at::Tensor& scales,
                       const StatePrecision& precision, at::ScalarType param_dtype);

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_STATE_PRECISION_H_
