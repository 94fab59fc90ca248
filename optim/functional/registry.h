// Registry of functional optimizers: PyTorch's functional_optim_map. Maps an optimizer name
// ("Adam") or a LibTorch optimizer type (torch::optim::Adam) to a factory of its functional twin;
// users register their own (see the QHM test).
//
//   auto& registry = dtrain::optim::FunctionalRegistry::global();
//   registry.register_optimizer("QHM", [](std::vector<at::Tensor> params, const OptionsDict& o) {
//     return std::make_unique<MyQHM>(std::move(params), o);
//   });
//   auto adam = registry.create<torch::optim::Adam>(params, options);  // FunctionalAdam
//   auto qhm = registry.create("QHM", params, options);
//
// Thread safety: registration and lookup are safe from any thread (a reader-writer lock taken
// only there); the optimizers created share nothing.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_REGISTRY_H_
#define DTRAIN_OPTIM_FUNCTIONAL_REGISTRY_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <typeindex>
#include <vector>

#include <torch/optim/optimizer.h>

#include "optim/functional/optimizer.h"

namespace dtrain::optim {

// The options key of PyTorch's functional-optimizer constructor argument: True lets a built-in
// be created with no parameters (a ZeroRedundancyOptimizer rank that owns none). It is not an
// option: set_options() refuses it and state_dict() has no such key.
inline constexpr char kAllowEmptyParamList[] = "_allow_empty_param_list";

using FunctionalFactory = std::function<std::unique_ptr<FunctionalOptimizer>(
    std::vector<at::Tensor> params, const OptionsDict& options)>;

class FunctionalRegistry {
 public:
  // The process-wide registry, holding the eight built-ins under their PyTorch names and the
  // LibTorch types torch::optim::SGD, Adam, AdamW, Adagrad and RMSprop.
  static FunctionalRegistry& global();

  // Registers (or replaces, as assigning into functional_optim_map does) a factory. `options`
  // passed to the factory hold only what the caller gave: defaults are the factory's business.
  void register_optimizer(const std::string& name, FunctionalFactory factory);
  // Also maps a LibTorch optimizer type to the factory registered under `name`.
  template <typename TorchOptimizer>
  void register_twin(const std::string& name) {
    register_type(std::type_index(typeid(TorchOptimizer)), name);
  }

  bool contains(const std::string& name) const;
  // Whether the optimizer registered under `name` updates each parameter whole, in its shape
  // (the built-in Adafactor and Muon): ZeroRedundancyOptimizer refuses to cut its parameters into
  // element ranges. False for other names unless set_whole_parameters said so.
  bool needs_whole_parameters(const std::string& name) const;
  // Marks the optimizer registered under `name` as one that needs whole parameters (the built-ins
  // do this for themselves; a caller registering such an optimizer can too). register_optimizer
  // clears the mark.
  void set_whole_parameters(const std::string& name, bool whole);
  template <typename TorchOptimizer>
  bool has_twin() const {
    return twin_name(std::type_index(typeid(TorchOptimizer))).has_value();
  }
  std::vector<std::string> names() const;
  // The registry name of a LibTorch optimizer type's twin ("" when it has none).
  template <typename TorchOptimizer>
  std::string name_of() const {
    return twin_name(std::type_index(typeid(TorchOptimizer))).value_or(std::string());
  }

  // Creates the functional optimizer registered under `name` (TORCH_CHECK listing the known
  // names if there is none). The built-ins also take PyTorch's constructor argument
  // `_allow_empty_param_list` (kAllowEmptyParamList, a bool, default false) in `options`: without
  // it an empty `params` is an error ("optimizer got an empty parameter list"), as in PyTorch.
  std::unique_ptr<FunctionalOptimizer> create(const std::string& name,
                                              std::vector<at::Tensor> params,
                                              const OptionsDict& options) const;
  // The functional twin of a LibTorch optimizer type.
  template <typename TorchOptimizer>
  std::unique_ptr<FunctionalOptimizer> create(std::vector<at::Tensor> params,
                                              const OptionsDict& options) const {
    const std::optional<std::string> name = twin_name(std::type_index(typeid(TorchOptimizer)));
    TORCH_CHECK(name.has_value(), "there is no supported functional optimizer equivalent for ",
                typeid(TorchOptimizer).name(),
                "; register one with register_optimizer + register_twin");
    return create(*name, std::move(params), options);
  }

 private:
  void register_type(std::type_index type, const std::string& name);
  // A copy, taken under the lock: register_twin may replace the entry at any time.
  std::optional<std::string> twin_name(std::type_index type) const;

  mutable std::shared_mutex mu_;
  std::map<std::string, FunctionalFactory> factories_;
  std::map<std::type_index, std::string> twins_;
  std::map<std::string, bool> whole_parameters_;
};

// PyTorch-named options (an OptionsDict) from LibTorch's options object for torch::optim::SGD,
// Adam, AdamW, Adagrad or RMSprop (optim/functional/torch_twins.h), so a LibTorch configuration can build its
// functional twin. TORCH_CHECK on another options type.
OptionsDict options_from_torch(const torch::optim::OptimizerOptions& options);

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_REGISTRY_H_
