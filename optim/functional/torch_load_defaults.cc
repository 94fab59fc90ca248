#include "optim/functional/torch_load_defaults.h"

#include <map>
#include <utility>
#include <vector>

namespace dtrain::optim {
namespace {

using Defaults = std::vector<std::pair<const char*, c10::IValue>>;

// The group.setdefault calls of torch/optim/<name>.py's __setstate__ (PyTorch 2.14.1; 2.6's are
// the same where the option exists). Keys an optimizer's table lacks (Adam's
// decoupled_weight_decay before 2.7) never reach the lookup.
const std::map<std::string, Defaults>& table() {
  static const auto* t = [] {
    const c10::IValue none;
    // foreach None, maximize False, differentiable False, capturable False: most optimizers'.
    const Defaults common = {
        {"foreach", none}, {"maximize", false}, {"differentiable", false}, {"capturable", false}};
    auto with = [&](Defaults extra, bool capturable = true) {
      Defaults d;
      for (const auto& kv : common) {
        if (capturable || std::string(kv.first) != "capturable") d.push_back(kv);
      }
      for (auto& kv : extra) d.push_back(std::move(kv));
      return d;
    };
    auto* m = new std::map<std::string, Defaults>();
    const Defaults adam = {{"amsgrad", false}, {"fused", none}};
    (*m)["Adam"] = with(adam);
    (*m)["Adam"].emplace_back("decoupled_weight_decay", false);
    (*m)["AdamW"] = with(adam);
    (*m)["AdamW"].emplace_back("decoupled_weight_decay", true);
    (*m)["Adadelta"] = with({});
    (*m)["Adagrad"] = with({{"fused", none}}, /*capturable=*/false);
    (*m)["Adamax"] = with({});
    (*m)["ASGD"] = with({});
    (*m)["NAdam"] = with({{"decoupled_weight_decay", false}});
    (*m)["RAdam"] = with({{"decoupled_weight_decay", false}});
    (*m)["RMSprop"] = with({{"momentum", 0.0}, {"centered", false}});
    (*m)["Rprop"] = with({});
    (*m)["SGD"] = with({{"nesterov", false}, {"fused", false}}, /*capturable=*/false);
    (*m)["Adafactor"] = {{"foreach", none}};
    // Muon and SparseAdam have no __setstate__: every option must be in the group.
    return m;
  }();
  return *t;
}

}  // namespace

std::optional<c10::IValue> torch_load_default(const std::string& optimizer,
                                              const std::string& key) {
  auto it = table().find(optimizer);
  if (it == table().end()) return std::nullopt;
  for (const auto& [k, v] : it->second) {
    if (key == k) return v;
  }
  return std::nullopt;
}

}  // namespace dtrain::optim
