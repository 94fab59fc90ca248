// The param-group options PyTorch fills in when a loaded state dict lacks them: what each
// torch.optim.<Name>.__setstate__ sets with group.setdefault(key, value) (PyTorch 2.6 to 2.14 set
// the same keys to the same values; AdamW sets decoupled_weight_decay=True whatever the dict says).
// A loaded group that lacks any other option is not one PyTorch can step with -- its next step()
// raises KeyError -- so FunctionalOptimizer::load_state_dict refuses it, naming the key, before
// anything is applied (docs/differences.md). Options a group lacks take these values, never the
// loading optimizer's current ones (PyTorch replaces the whole group).
//
//   torch_load_default("SGD", "nesterov")  // false
//   torch_load_default("SGD", "lr")        // nullopt: a group without lr is refused
#ifndef DTRAIN_OPTIM_FUNCTIONAL_TORCH_LOAD_DEFAULTS_H_
#define DTRAIN_OPTIM_FUNCTIONAL_TORCH_LOAD_DEFAULTS_H_

#include <optional>
#include <string>

#include <ATen/core/ivalue.h>

namespace dtrain::optim {

// PyTorch's value for `key` when optimizer `optimizer` (PyTorch's class name: "Adam", "RMSprop")
// loads a param group without it; nullopt when PyTorch sets none.
std::optional<c10::IValue> torch_load_default(const std::string& optimizer, const std::string& key);

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_TORCH_LOAD_DEFAULTS_H_
