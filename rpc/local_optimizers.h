// LibTorch optimizers with no functional form (a user's own torch::optim::Optimizer, say) for
// the RPC DistributedOptimizer: each owner builds the optimizer itself over its parameters and
// steps it under its per-owner lock, with each parameter's .grad set to the context's gradient
// for the step (PyTorch's _LocalOptimizer fallback, which it takes with a warning). Options
// travel as an OptionsDict: a registration says how to turn the options object into one and
// back. Register on every worker, as functional optimizers are.
//
//   dtrain::rpc::LocalOptimizerRegistry::global().register_optimizer<MyOpt, MyOptions>(
//       "MyOpt",
//       [](const MyOptions& o) { auto d = dtrain::optim::new_options_dict(); d.insert("lr", o.lr()); return d; },
//       [](const dtrain::optim::OptionsDict& d) { return MyOptions(d.at("lr").toDouble()); });
//   auto opt = DistributedOptimizer::create<MyOpt>(*agent, MyOptions(0.1), params);  // TORCH_WARNs
//
// A functional twin (optim/functional/registry.h), when there is one, is always preferred: it needs no
// .grad and no state in a torch::optim object. Thread safety: registration and lookup from any
// thread (a reader-writer lock taken only there).
#ifndef DTRAIN_RPC_LOCAL_OPTIMIZERS_H_
#define DTRAIN_RPC_LOCAL_OPTIMIZERS_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <typeindex>
#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include "optim/functional/optimizer.h"

namespace dtrain::rpc {

using LocalOptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(
    std::vector<at::Tensor> params, const optim::OptionsDict& options)>;
using OptionsToDict =
    std::function<optim::OptionsDict(const torch::optim::OptimizerOptions& options)>;

class LocalOptimizerRegistry {
 public:
  static LocalOptimizerRegistry& global();

  // Registers (or replaces) T under `name`: owners build T(params, from_dict(options)); a client's
  // DistributedOptimizer::create<T>(agent, options, params) sends to_dict(options).
  template <typename T, typename Options>
  void register_optimizer(const std::string& name,
                          std::function<optim::OptionsDict(const Options&)> to_dict,
                          std::function<Options(const optim::OptionsDict&)> from_dict) {
    TORCH_CHECK(to_dict && from_dict, "register_optimizer(", name,
                ") needs both to_dict and from_dict");
    add(
        name, std::type_index(typeid(T)),
        [from_dict](std::vector<at::Tensor> params,
                    const optim::OptionsDict& d) -> std::unique_ptr<torch::optim::Optimizer> {
          return std::make_unique<T>(std::move(params), from_dict(d));
        },
        [to_dict, name](const torch::optim::OptimizerOptions& o) {
          const auto* typed = dynamic_cast<const Options*>(&o);
          TORCH_CHECK(typed != nullptr, name, " was registered with options of type ",
                      typeid(Options).name(), " but got ", typeid(o).name());
          return to_dict(*typed);
        });
  }

  bool contains(const std::string& name) const;
  std::vector<std::string> names() const;
  // TORCH_CHECK naming the registered ones when `name` is not.
  std::unique_ptr<torch::optim::Optimizer> create(const std::string& name,
                                                  std::vector<at::Tensor> params,
                                                  const optim::OptionsDict& options) const;

  struct TypeEntry {
    std::string name;
    OptionsToDict to_dict;
  };
  template <typename T>
  std::optional<TypeEntry> find() const {
    return find(std::type_index(typeid(T)));
  }

 private:
  void add(const std::string& name, std::type_index type, LocalOptimizerFactory factory,
           OptionsToDict to_dict);
  std::optional<TypeEntry> find(std::type_index type) const;

  mutable std::shared_mutex mu_;
  std::map<std::string, LocalOptimizerFactory> factories_;
  std::map<std::type_index, TypeEntry> types_;
};

}  // namespace dtrain::rpc

#endif  // DTRAIN_RPC_LOCAL_OPTIMIZERS_H_
