// Adam's and AdamW's param_remainders (state_precision.h's split_master): a bfloat16 parameter
// and its int16 remainder (state slot Traits::kRemainderSlot, "param_remainder") hold a float32
// master weight. A step joins each stepped parameter's master, converts its bfloat16 gradient to
// float32, runs the float32 update on the masters (drive: fused kernel, low-precision state,
// ATen, CUDA, exactly as for a float32 parameter equal to the master) and splits the masters back.
// The remainder is hidden from the float32 update's slot handling while it runs. The masters and
// float32 gradients are transient: 8 bytes per stepped element during the step, none after it.
// Internal to optim/.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_PARAM_REMAINDERS_H_
#define DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_PARAM_REMAINDERS_H_

#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

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

// The update with param_remainders=True (see the file comment). Nothing changes when a check
// fails: a non-bfloat16 parameter, or drive's own checks (require_state).
template <typename Traits, typename Options>
void drive_with_remainders(const std::string& name, std::vector<at::Tensor>& params,
                           std::vector<ParamState>& state, const Options& o,
                           const std::vector<std::pair<size_t, at::Tensor>>& work) {
  constexpr size_t kSlot = Traits::kRemainderSlot;
  for (const auto& [i, g] : work) check_remainder_param(name, params[i], i);
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
