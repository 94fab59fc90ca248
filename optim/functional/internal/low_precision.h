// The update of optimizer state kept in bfloat16 or 8 bits (optim/functional/state_precision.h):
// a descriptor's low_precision_kernel over every eligible CPU tensor in one parallel pass, in
// place, and for every other parameter (another optimizer, another device or dtype) the float
// path on that parameter's decoded state, stored back afterwards. Both give the same bits: the
// kernel's arithmetic is the float kernel's, and the rounding bits are keyed by the element.
// Internal to optim/.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_LOW_PRECISION_H_
#define DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_LOW_PRECISION_H_

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "optim/functional/internal/fused.h"
#include "optim/functional/optimizer.h"
#include "optim/functional/state_precision.h"

namespace dtrain::optim::internal {

// internal/optimizer_impl.h's float path.
template <typename Traits, typename Options>
void drive_fused(std::vector<at::Tensor>& params, std::vector<ParamState>& state, const Options& o,
                 const std::vector<std::pair<size_t, at::Tensor>>& work);

// One float32 CPU tensor's part in a low-precision fused update: parameter, gradient, the slots
// (bfloat16 bits or 8-bit codes) with their block scales, the per-tensor scalars and each slot's
// rounding salt (rounding_salt of its rounding_key: slots 0 and 1 share one, as do 2 and 3).
// With param_remainders (internal/param_remainders.h) the parameter is a bfloat16 one with its int16
// remainder (pb, rem) and the gradient bfloat16 (gb), and p and g are null: the kernels join the
// float32 master per element, update it and split it back in place.
struct LowPrecisionTensor {
  float* p = nullptr;
  const float* g = nullptr;
  uint16_t* pb = nullptr;
  int16_t* rem = nullptr;
  const uint16_t* gb = nullptr;
  std::array<void*, 4> s{};
  std::array<float*, 4> absmax{};
  std::array<uint32_t, 4> salt{};
  int64_t n = 0;
  std::array<double, 4> c{};
};

// A kernel's view of a LowPrecisionTensor's parameter and gradient, per element: float32 ones
// (kRemainders false) or param_remainders' bfloat16 parameter + remainder and bfloat16 gradient,
// whose master is state_precision.h's join_master / split_master, bit for bit.
template <bool kRemainders>
struct ParamAccess {
  explicit ParamAccess(const LowPrecisionTensor& t) : p(t.p), g(t.g) {}
  float param(int64_t k) const { return p[k]; }
  float grad(int64_t k) const { return g[k]; }
  void store(int64_t k, float x) const { p[k] = x; }
  float* __restrict p;
  const float* __restrict g;
};
template <>
struct ParamAccess<true> {
  explicit ParamAccess(const LowPrecisionTensor& t) : p(t.pb), r(t.rem), g(t.gb) {}
  float param(int64_t k) const { return join_master(p[k], r[k]); }
  float grad(int64_t k) const { return bf16_value(g[k]); }
  void store(int64_t k, float x) const { split_master(x, &p[k], &r[k]); }
  uint16_t* __restrict p;
  int16_t* __restrict r;
  const uint16_t* __restrict g;
};

// Tests force the float path for every parameter, to compare it with the kernels.
inline std::atomic<bool>& low_precision_kernels_enabled() {
  static std::atomic<bool> enabled{true};
  return enabled;
}

template <typename Options>
StatePrecision precision_of(const std::string& name, const Options& o, bool allow_8bit) {
  return parse_state_precision(name, o.state_dtype(), o.state_stochastic_rounding(), o.state_seed(),
                               allow_8bit);
}

// Calls kernel(tensor, begin, end) over block-aligned element ranges (kQuantBlock) that cover every
// element of every tensor once, in parallel, split as for_each_range splits the float kernels'
// (fused_split(): by default every thread takes its share of every tensor, in whole blocks).
template <typename Kernel>
void for_each_block_range(const std::vector<LowPrecisionTensor>& tensors, const Kernel& kernel) {
  if (tensors.empty()) return;
  std::vector<int64_t> start(tensors.size() + 1, 0);
  for (size_t i = 0; i < tensors.size(); ++i) start[i + 1] = start[i] + quant_blocks(tensors[i].n);
  const int64_t grain = std::max<int64_t>(1, kFusedGrain / kQuantBlock);
  const int64_t threads = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), (start.back() + grain - 1) / grain));
  if (fused_split().load(std::memory_order_relaxed) == FusedSplit::kEachTensor && threads > 1) {
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
      for (int64_t part = first; part < last; ++part) {
        for (const LowPrecisionTensor& t : tensors) {
          const int64_t share = (quant_blocks(t.n) + threads - 1) / threads * kQuantBlock;
          const int64_t lo = std::min(t.n, part * share), hi = std::min(t.n, lo + share);
          if (hi > lo) kernel(t, lo, hi);
        }
      }
    });
    return;
  }
  at::parallel_for(0, start.back(), grain, [&](int64_t begin, int64_t end) {
    size_t t =
        static_cast<size_t>(std::upper_bound(start.begin(), start.end(), begin) - start.begin()) -
        1;
    for (; t < tensors.size() && start[t] < end; ++t) {
      const int64_t lo = (std::max(begin, start[t]) - start[t]) * kQuantBlock;
      const int64_t hi =
          std::min(tensors[t].n, (std::min(end, start[t + 1]) - start[t]) * kQuantBlock);
      if (hi > lo) kernel(tensors[t], lo, hi);
    }
  });
}

// The float path for one parameter: its slots decoded to the parameter's dtype, the float update
// (fused kernel or ATen), the slots stored back at `precision`, scalar slots untouched.
template <typename Traits, typename Options, typename FloatStep>
void step_through_float(std::vector<at::Tensor>& params, std::vector<ParamState>& state, size_t i,
                        const at::Tensor& g, const Options& o, const StatePrecision& precision,
                        const FloatStep& float_step) {
  ParamState& s = state[i];
  const at::ScalarType dtype = params[i].scalar_type();
  std::vector<ParamState> shadow(1);
  ParamState& f = shadow[0];
  f.initialized = s.initialized;
  f.step = s.step;
  f.device_step = s.device_step;
  f.device_step_value = s.device_step_value;
  for (size_t k = 0; k < 4; ++k) {
    if (!s.slots[k].defined()) continue;
    f.slots[k] = Traits::kScalarSlots[k]
                     ? s.slots[k]
                     : slot_values(s.slots[k], s.scales[k], Traits::kSignedSlots[k], dtype).clone();
  }
  std::vector<at::Tensor> one = {params[i]};
  float_step(one, shadow, g);
  s.initialized = f.initialized;
  s.step = f.step;
  // SGD and Muon count no steps; stochastic rounding needs fresh bits every step, so their
  // low-precision state counts its own (state_dict() writes it as "step").
  if constexpr (Traits::kStep == FunctionalOptimizer::StepKind::kNone) s.step += 1;
  s.device_step = f.device_step;
  s.device_step_value = f.device_step_value;
  for (size_t k = 0; k < 4; ++k) {
    if (!f.slots[k].defined() || Traits::kScalarSlots[k]) {
      s.slots[k] = f.slots[k];
      s.scales[k] = at::Tensor();
      continue;
    }
    store_slot(f.slots[k], precision, Traits::kSignedSlots[k],
               rounding_key(precision.seed, s.step, i, k), dtype, &s.slots[k], &s.scales[k]);
  }
}

// Whether the descriptor's low-precision kernel can take parameter i's update in place.
inline bool low_precision_fusable(const at::Tensor& p, const at::Tensor& g) {
  return p.is_cpu() && p.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat &&
         p.is_contiguous() && g.is_contiguous() && !g.is_sparse() && g.sizes().equals(p.sizes());
}

// The low-precision counterpart of drive_fused (see the file comment).
template <typename Traits, typename Options>
void drive_low_precision(std::vector<at::Tensor>& params, std::vector<ParamState>& state,
                         const Options& o, const std::vector<std::pair<size_t, at::Tensor>>& work,
                         const StatePrecision& precision) {
  auto float_step = [&](std::vector<at::Tensor>& one, std::vector<ParamState>& shadow,
                        const at::Tensor& g) {
    if constexpr (Traits::kFused) {
      drive_fused<Traits>(one, shadow, o, {{0, g}});
    } else {
      const bool first = Traits::prepare(shadow[0], one[0], g, o);
      Traits::aten(shadow[0], one[0], g, o, first);
    }
  };
  std::vector<LowPrecisionTensor> fused;
  for (const auto& [i, g] : work) {
    if constexpr (Traits::kLowPrecisionKernel) {
      if (low_precision_kernels_enabled().load(std::memory_order_relaxed) &&
          low_precision_fusable(params[i], g)) {
        fused.push_back(Traits::low_precision_tensor(state[i], params[i], g, o, precision, i));
        continue;
      }
    }
    step_through_float<Traits>(params, state, i, g, o, precision, float_step);
  }
  if constexpr (Traits::kLowPrecisionKernel) {
    const KernelIsa isa = kernel_isa();
    for_each_block_range(fused, [&](const LowPrecisionTensor& t, int64_t lo, int64_t hi) {
      Traits::low_precision_kernel(isa, t, lo, hi, o, precision);
    });
  }
}

// Makes parameter i's slots (as prepare() left them: fresh ones in the parameter's dtype) kept at
// `precision`, and fills t's slot pointers and salts. For low_precision_tensor implementations.
inline void bind_low_precision_slots(ParamState& s, const std::array<bool, 4>& signed_slots,
                                     const StatePrecision& precision, size_t i,
                                     LowPrecisionTensor& t) {
  for (size_t k = 0; k < 4; ++k) {
    if (!s.slots[k].defined()) continue;
    if (!slot_is_stored_as(s.slots[k], s.scales[k], precision, at::kFloat) ||
        !s.slots[k].is_contiguous()) {
      const at::Tensor values = slot_values(s.slots[k], s.scales[k], signed_slots[k], at::kFloat);
      store_slot(values, precision, signed_slots[k], rounding_key(precision.seed, s.step, i, k),
                 at::kFloat, &s.slots[k], &s.scales[k]);
      s.slots[k] = s.slots[k].contiguous();
    }
    t.s[k] = s.slots[k].data_ptr();
    t.absmax[k] = s.scales[k].defined() ? s.scales[k].data_ptr<float>() : nullptr;
    t.salt[k] = rounding_salt(rounding_key(precision.seed, s.step, i, k));
  }
}

}  // namespace dtrain::optim::internal

#endif  // DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_LOW_PRECISION_H_
