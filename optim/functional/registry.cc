#include "optim/functional/registry.h"

#include <mutex>

#include "optim/functional/optimizers.h"
#include "optim/functional/torch_twins.h"

namespace dtrain::optim {
namespace {

// Registers a built-in under its table's name: the factory starts from the table's defaults,
// applies the caller's options over them, and takes PyTorch's `_allow_empty_param_list`
// constructor argument from the dict too (it is not an option).
template <typename Functional>
void register_builtin(FunctionalRegistry& r) {
  const auto& table = Functional::option_table();
  r.register_optimizer(
      table.name(), [&table](std::vector<at::Tensor> params, const OptionsDict& options) {
        OptionsDict rest = options.copy();
        bool allow_empty = false;
        if (rest.contains(kAllowEmptyParamList)) {
          const c10::IValue v = rest.at(kAllowEmptyParamList);
          TORCH_CHECK(v.isBool(), table.name(), ": ", kAllowEmptyParamList, " must be a bool, got ",
                      v.tagKind());
          allow_empty = v.toBool();
          (void)rest.erase(kAllowEmptyParamList);  // the count is known: contains() said 1
        }
        return std::unique_ptr<FunctionalOptimizer>(
            std::make_unique<Functional>(std::move(params), table.resolve(rest), allow_empty));
      });
  r.set_whole_parameters(table.name(), Functional::needs_whole_parameters());
}

}  // namespace

FunctionalRegistry& FunctionalRegistry::global() {
  static FunctionalRegistry* registry = [] {
    auto* r = new FunctionalRegistry();
#define DTRAIN_REGISTER_BUILTIN(T) register_builtin<T>(*r);
    DTRAIN_BUILTIN_OPTIMIZERS(DTRAIN_REGISTER_BUILTIN)  // builtin.bzl's list
#undef DTRAIN_REGISTER_BUILTIN
    // The LibTorch twins (optim/functional/torch_twins.h) map to the built-ins of their name.
    for (const TorchTwin& twin : torch_twins()) r->register_type(twin.optimizer, twin.name);
    return r;
  }();
  return *registry;
}

void FunctionalRegistry::register_optimizer(const std::string& name, FunctionalFactory factory) {
  TORCH_CHECK(!name.empty(), "register_optimizer: empty name");
  TORCH_CHECK(factory != nullptr, "register_optimizer: null factory for '", name, "'");
  std::unique_lock<std::shared_mutex> lock(mu_);
  factories_[name] = std::move(factory);
  whole_parameters_.erase(name);  // a replaced built-in's flag no longer applies
}

void FunctionalRegistry::register_type(std::type_index type, const std::string& name) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  TORCH_CHECK(factories_.count(name), "register_twin: no functional optimizer named '", name,
              "' is registered; register_optimizer it first");
  twins_.insert_or_assign(type, name);
}

std::optional<std::string> FunctionalRegistry::twin_name(std::type_index type) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  auto it = twins_.find(type);
  if (it == twins_.end()) return std::nullopt;
  return it->second;
}

bool FunctionalRegistry::contains(const std::string& name) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return factories_.count(name) > 0;
}

bool FunctionalRegistry::needs_whole_parameters(const std::string& name) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  auto it = whole_parameters_.find(name);
  return it != whole_parameters_.end() && it->second;
}

void FunctionalRegistry::set_whole_parameters(const std::string& name, bool whole) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  whole_parameters_[name] = whole;
}

std::vector<std::string> FunctionalRegistry::names() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& kv : factories_) out.push_back(kv.first);
  return out;
}

std::unique_ptr<FunctionalOptimizer> FunctionalRegistry::create(const std::string& name,
                                                                std::vector<at::Tensor> params,
                                                                const OptionsDict& options) const {
  FunctionalFactory f;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    auto it = factories_.find(name);
    if (it != factories_.end()) f = it->second;
  }
  if (!f) {
    std::string known;
    for (const auto& n : names()) known += (known.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, "no functional optimizer named '", name, "' is registered (known: ", known,
                ")");
  }
  return f(std::move(params), options);
}

OptionsDict options_from_torch(const torch::optim::OptimizerOptions& options) {
  const TorchTwin* twin = twin_of(options);
  TORCH_CHECK(twin != nullptr, "options_from_torch: unsupported LibTorch options type ",
              typeid(options).name(), " (SGD, Adam, AdamW, Adagrad and RMSprop options are)");
  return twin->options_to_dict(options);
}

}  // namespace dtrain::optim
