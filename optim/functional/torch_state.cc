#include "optim/functional/torch_state.h"

#include <memory>
#include <vector>

#include "checkpoint/optimizer_state_dict.h"
#include "optim/functional/adapter.h"
#include "optim/functional/libtorch_compat.h"
#include "optim/functional/registry.h"
#include "optim/functional/torch_twins.h"

namespace dtrain::optim {

c10::IValue torch_optim_state_dict(const torch::optim::Optimizer& optimizer) {
  checkpoint::OptimizerStateDict sd;
  int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    const torch::optim::OptimizerOptions& o =
        group.has_options() ? group.options() : optimizer.defaults();
    checkpoint::ParamGroup g;
    g.options = options_from_torch(o);  // TORCH_CHECKs the type
    for (const auto& p : group.params()) {
      g.params.push_back(index);
      auto it = optimizer.state().find(param_state_key(p));
      if (it != optimizer.state().end()) {
        const torch::optim::OptimizerParamState& s = *it->second;
        const TorchTwin* twin = twin_of(s);
        TORCH_CHECK(twin != nullptr, "torch_optim_state_dict: unsupported parameter state type ",
                    typeid(s).name());
        sd.state.emplace(index, twin->state_to_entry(s));
      }
      ++index;
    }
    sd.param_groups.push_back(std::move(g));
  }
  return checkpoint::to_ivalue(sd);
}

void load_torch_optim_state_dict(torch::optim::Optimizer& optimizer,
                                 const c10::IValue& state_dict) {
  absl::StatusOr<checkpoint::OptimizerStateDict> sd = checkpoint::parse_optimizer_state_dict(
      state_dict, "load_torch_optim_state_dict: the state dict");
  TORCH_CHECK(sd.ok(), sd.status().message());
  TORCH_CHECK(sd->param_groups.size() == optimizer.param_groups().size(),
              "load_torch_optim_state_dict: the state dict has ", sd->param_groups.size(),
              " parameter groups, the optimizer has ", optimizer.param_groups().size());
  const TorchTwin* twin = twin_of(optimizer.defaults());
  TORCH_CHECK(twin != nullptr,
              "load_torch_optim_state_dict: unsupported optimizer (SGD, Adam, AdamW, Adagrad, "
              "RMSprop are)");
  // Everything is built first, so that a refused group or entry leaves the optimizer as it was.
  std::remove_reference_t<decltype(optimizer.state())> loaded;
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options(sd->param_groups.size());
  for (size_t gi = 0; gi < sd->param_groups.size(); ++gi) {
    const checkpoint::ParamGroup& group = sd->param_groups[gi];
    auto& target = optimizer.param_groups()[gi];
    TORCH_CHECK(group.params.size() == target.params().size(),
                "load_torch_optim_state_dict: group ", gi, " has ", group.params.size(),
                " parameters in the state dict and ", target.params().size(), " in the optimizer");
    if (target.has_options()) {
      if (const TorchTwin* own = twin_of(target.options())) {
        options[gi] = target.options().clone();
        own->apply_options(*options[gi], group.options);
      }
    }
    for (size_t i = 0; i < group.params.size(); ++i) {
      auto it = sd->state.find(group.params[i]);
      if (it == sd->state.end()) continue;
      const at::Tensor& p = target.params()[i];
      loaded[param_state_key(p)] = twin->state_from_entry(it->second, p, group.params[i]);
    }
  }
  for (size_t gi = 0; gi < options.size(); ++gi) {
    if (options[gi]) optimizer.param_groups()[gi].set_options(std::move(options[gi]));
  }
  optimizer.state() = std::move(loaded);
}

c10::IValue optimizer_state_dict(torch::optim::Optimizer& optimizer) {
  if (auto* adapter = dynamic_cast<FunctionalOptimizerAdapter*>(&optimizer))
    return adapter->state_dict();
  return torch_optim_state_dict(optimizer);
}

void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state_dict) {
  if (auto* adapter = dynamic_cast<FunctionalOptimizerAdapter*>(&optimizer)) {
    adapter->load_state_dict(state_dict);
  } else {
    load_torch_optim_state_dict(optimizer, state_dict);
  }
}

int64_t state_tensor_bytes(const c10::IValue& state_dict) {
  absl::StatusOr<checkpoint::OptimizerStateDict> sd =
      checkpoint::parse_optimizer_state_dict(state_dict, "state_tensor_bytes");
  TORCH_CHECK(sd.ok(), sd.status().message());
  return checkpoint::state_tensor_bytes(*sd);
}

}  // namespace dtrain::optim
