#include "rpc/local_optimizers.h"

#include <mutex>

#include "absl/strings/str_join.h"

namespace dtrain::rpc {

LocalOptimizerRegistry& LocalOptimizerRegistry::global() {
  static LocalOptimizerRegistry* registry = new LocalOptimizerRegistry();
  return *registry;
}

void LocalOptimizerRegistry::add(const std::string& name, std::type_index type,
                                 LocalOptimizerFactory factory, OptionsToDict to_dict) {
  TORCH_CHECK(!name.empty(), "LocalOptimizerRegistry: an optimizer needs a name");
  std::unique_lock<std::shared_mutex> lock(mu_);
  factories_[name] = std::move(factory);
  types_[type] = TypeEntry{name, std::move(to_dict)};
}

bool LocalOptimizerRegistry::contains(const std::string& name) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return factories_.count(name) > 0;
}

std::vector<std::string> LocalOptimizerRegistry::names() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& kv : factories_) out.push_back(kv.first);
  return out;
}

std::unique_ptr<torch::optim::Optimizer> LocalOptimizerRegistry::create(
    const std::string& name, std::vector<at::Tensor> params,
    const optim::OptionsDict& options) const {
  LocalOptimizerFactory factory;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    auto it = factories_.find(name);
    if (it != factories_.end()) factory = it->second;
  }
  TORCH_CHECK(factory != nullptr, "no LibTorch optimizer named '", name,
              "' is registered with rpc::LocalOptimizerRegistry on this worker (registered: ",
              absl::StrJoin(names(), ", "), "); register it on every worker");
  std::unique_ptr<torch::optim::Optimizer> out = factory(std::move(params), options);
  TORCH_CHECK(out != nullptr, "the factory of '", name, "' returned no optimizer");
  return out;
}

std::optional<LocalOptimizerRegistry::TypeEntry> LocalOptimizerRegistry::find(
    std::type_index type) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  auto it = types_.find(type);
  if (it == types_.end()) return std::nullopt;
  return it->second;
}

}  // namespace dtrain::rpc
