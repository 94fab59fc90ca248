// Hostile optimizer state dicts for optim:state_dict_campaign_test: from one real state dict
// (PyTorch's, written by optim/testdata/make_campaign_states.py), every variant a damaged or
// edited file could hold -- each state key x {wrong size, wrong dtype, NaN, inf, negative,
// string, missing, ...}, "step" x {NaN, inf, -50, 1e300, 2.5, a string, a 2-element tensor, ...},
// param indices out of range, duplicated or permuted, option values NaN, inf, negative or strings,
// each option missing (accepted with PyTorch's value where PyTorch's load fills it in) -- each with what loading it must do (refuse it naming the key and the parameter's index in the
// file, or accept it as PyTorch does). Test-only.
//
//   for (const Hostile& h : hostile_variants(state_dict, params)) load(h.state_dict) ...
#ifndef DTRAIN_OPTIM_HOSTILE_STATE_DICTS_H_
#define DTRAIN_OPTIM_HOSTILE_STATE_DICTS_H_

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

namespace dtrain::optim::testing {

struct Hostile {
  std::string label;  // "state[1]['exp_avg'] nan"
  std::string kind;   // "nan", "inf", "wrong size", ... (for the counts)
  c10::IValue state_dict;
  // Refused (c10::Error, one line, naming every string in `names`), or accepted: PyTorch accepts
  // it too (a negative moment, a float64 tensor it casts, SGD without a momentum buffer).
  bool refused = true;
  std::vector<std::string> names;
  // Accepted variants whose next update PyTorch also makes non-finite (a negative second moment
  // under a square root): not checked for finite parameters after a step.
  bool may_go_non_finite = false;
  // An accepted variant that dropped an option: the option and the value PyTorch gives it on
  // load (the loaded optimizer's param group must say the same).
  std::string option_key;
  c10::IValue option_after;
};

// Every variant of `state_dict` (one param group, state for some of `params`; an optimizer whose
// required state keys are those every entry of `state_dict` has, but SGD's momentum_buffer).
// `missing_options` (make_campaign_states.py's, None to leave these variants out): for each option
// of the group, {"accepted": whether PyTorch loads and steps without it, "value": its value then}.
std::vector<Hostile> hostile_variants(const c10::IValue& state_dict,
                                      const std::vector<at::Tensor>& params,
                                      const std::string& optimizer,
                                      const c10::IValue& missing_options = c10::IValue());

}  // namespace dtrain::optim::testing

#endif  // DTRAIN_OPTIM_HOSTILE_STATE_DICTS_H_
