// Adam's and AdamW's param_remainders (state_precision.h's split_master): a bfloat16 parameter
// and its int16 remainder (state slot Traits::kRemainderSlot, "param_remainder") hold a float32
// master weight. A step joins each stepped parameter's master, converts its bfloat16 gradient to
// float32, runs the float32 update on the masters (drive: fused kernel, low-precision state,
// ATen, CUDA, exactly as for a float32 parameter equal to the master) and splits the masters back.
// The remainder is hidden from the float32 update's slot handling while it runs. The masters and
// float32 gradients are transient: 8 bytes per stepped element during the step, none after it.
// With CPU tensors and bfloat16 gradients, the descriptor's low-precision kernel instead joins,
// updates and splits each element in place (state in bfloat16 or 8 bits, or float32 unless
// fused=True asks for ATen's fused kernel)
// (drive_remainders_in_place): the same arithmetic on the same master, so the same bits, with no
// transient tensors. Internal to optim/.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_PARAM_REMAINDERS_H_
#define DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_PARAM_REMAINDERS_H_

#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "optim/functional/internal/low_precision.h"
#include "optim/functional/optimizer.h"
#include "optim/functional/state_precision.h"

namespace dtrain::optim::internal {

// internal/optimizer_impl.h's driver.
template <typename Traits, typename Options>
void drive(const std::string& name, std::vector<at::Tensor>& params, std::vector<ParamState>& state,
           const Options& o, const std::vector<std::pair<size_t, at::Tensor>>& work);

inline void check_remainder_param(const std::string& name, const at::Tensor& p, size_t index) {
  TORCH_CHECK(p.scalar_type() == at::kBFloat16, name,
              ": param_remainders=True keeps a 16-bit remainder for bfloat16 parameters only, "
              "but parameter ",
              index, " is ", p.scalar_type(),
              "; make the parameter bfloat16, or give it an optimizer with "
              "param_remainders=False (a float32 parameter is its own master weight)");
}

// At construction: every parameter bfloat16 when the options ask for remainders.
template <typename Options>
void check_remainder_params(const std::string& name, const std::vector<at::Tensor>& params,
                            const Options& o) {
  if constexpr (requires { o.param_remainders(); }) {
    if (!o.param_remainders()) return;
    for (size_t i = 0; i < params.size(); ++i) check_remainder_param(name, params[i], i);
  }
}

// Whether the low-precision kernel can take every stepped parameter in place: state in bfloat16
// or 8 bits, or float32 (the master's dtype) where fused=True does not ask for ATen's kernel;
// contiguous CPU bfloat16 parameters with dense bfloat16 gradients of their shape; remainders
// (where there are any yet) contiguous int16 of that shape.
template <typename Traits, typename Options>
bool remainders_in_place(const std::vector<at::Tensor>& params,
                         const std::vector<ParamState>& state, const Options& o,
                         const std::vector<std::pair<size_t, at::Tensor>>& work,
                         const StatePrecision& precision) {
  if (!low_precision_kernels_enabled().load(std::memory_order_relaxed) ||
      (precision.dtype == StateDtype::kParam && o.fused().value_or(false))) {
    return false;
  }
  for (const auto& [i, g] : work) {
    const at::Tensor& p = params[i];
    const at::Tensor& r = state[i].slots[Traits::kRemainderSlot];
    if (!p.is_cpu() || p.scalar_type() != at::kBFloat16 || !p.is_contiguous() || g.is_sparse() ||
        g.scalar_type() != at::kBFloat16 || !g.is_contiguous() || !g.sizes().equals(p.sizes())) {
      return false;
    }
    if (r.defined() && (!r.is_cpu() || r.scalar_type() != at::kShort || !r.is_contiguous() ||
                        !r.sizes().equals(p.sizes()))) {
      return false;
    }
  }
  return true;
}

// The in-place form of drive_with_remainders (see the file comment): drive()'s sequence for state
// at `precision` (require_state, the low-precision kernel over every tensor, finish) on the
// bfloat16 parameters, each with its remainder.
template <typename Traits, typename Options>
void drive_remainders_in_place(const std::string& name, std::vector<at::Tensor>& params,
                               std::vector<ParamState>& state, const Options& o,
                               const std::vector<std::pair<size_t, at::Tensor>>& work,
                               const StatePrecision& precision) {
  constexpr size_t kSlot = Traits::kRemainderSlot;
  for (const auto& [i, g] : work) Traits::require_state(name, state[i], params[i], i, o);
  std::vector<LowPrecisionTensor> tensors;
  for (const auto& [i, g] : work) {
    // None yet (a first step, a state without one): remainder 0, the master is the parameter.
    at::Tensor remainder = state[i].slots[kSlot];
    if (!remainder.defined()) remainder = at::zeros_like(params[i], at::kShort);
    state[i].slots[kSlot] = at::Tensor();  // not one of the slots kept at `precision`
    try {
      tensors.push_back(Traits::low_precision_tensor(state[i], params[i], g, o, precision, i));
    } catch (...) {
      state[i].slots[kSlot] = remainder;
      throw;
    }
    state[i].slots[kSlot] = remainder;
    tensors.back().rem = remainder.data_ptr<int16_t>();
  }
  const KernelIsa isa = kernel_isa();
  for_each_block_range(tensors, [&](const LowPrecisionTensor& t, int64_t lo, int64_t hi) {
    Traits::low_precision_kernel(isa, t, lo, hi, o, precision);
  });
  for (const auto& item : work) Traits::finish(state[item.first], o);
}

// The update with param_remainders=True (see the file comment). Nothing changes when a check
// fails: a non-bfloat16 parameter, or drive's own checks (require_state).
template <typename Traits, typename Options>
void drive_with_remainders(const std::string& name, std::vector<at::Tensor>& params,
                           std::vector<ParamState>& state, const Options& o,
                           const std::vector<std::pair<size_t, at::Tensor>>& work) {
  constexpr size_t kSlot = Traits::kRemainderSlot;
  for (const auto& [i, g] : work) check_remainder_param(name, params[i], i);
  if constexpr (Traits::kLowPrecisionKernel) {
    const StatePrecision precision = precision_of(name, o, Traits::k8Bit);
    if (remainders_in_place<Traits>(params, state, o, work, precision)) {
      return drive_remainders_in_place<Traits>(name, params, state, o, work, precision);
    }
  }
  std::vector<at::Tensor> masters = params;  // the stepped entries replaced by float32 masters
  std::vector<std::pair<size_t, at::Tensor>> master_work;
  std::vector<at::Tensor> saved, remainders;  // as they were; as the step uses them
  for (const auto& [i, g] : work) {
    at::Tensor& slot = state[i].slots[kSlot];
    saved.push_back(slot);
    // None yet (a first step, a state without one): remainder 0, the master is the parameter.
    remainders.push_back(
        slot.defined() ? slot : at::zeros_like(params[i], params[i].options().dtype(at::kShort)));
    slot = at::Tensor();
    masters[i] = master_weight(params[i], remainders.back());
    master_work.emplace_back(i, g.to(at::kFloat).contiguous());
  }
  Options float_options = o;
  float_options.param_remainders(false);
  try {
    drive<Traits>(name, masters, state, float_options, master_work);
  } catch (...) {
    for (size_t k = 0; k < work.size(); ++k) state[work[k].first].slots[kSlot] = saved[k];
    throw;
  }
  for (size_t k = 0; k < work.size(); ++k) {
    const size_t i = work[k].first;
    split_master_weight(masters[i], params[i], remainders[k]);
    state[i].slots[kSlot] = remainders[k];
  }
}

}  // namespace dtrain::optim::internal

#endif  // DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_PARAM_REMAINDERS_H_
