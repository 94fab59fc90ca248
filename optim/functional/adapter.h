// Presents functional optimizers as a LibTorch torch::optim::Optimizer (param groups, step with a
// closure, zero_grad, LR schedulers), so a functional optimizer -- a built-in or one registered by
// the user -- can be the local optimizer inside ZeroRedundancyOptimizer or any LibTorch loop.
//
//   OptionsDict defaults = dtrain::optim::new_options_dict();
//   defaults.insert("lr", 1e-3);
//   dtrain::optim::FunctionalOptimizerAdapter opt(model->parameters(), "Adam", defaults);
//   opt.zero_grad();
//   loss.backward();
//   opt.step();                                            // Adam on each p.grad()
//   opt.param_groups()[0].options().set_lr(1e-4);          // schedulers work as with torch::optim
//
// Each param group gets its own functional optimizer (functional optimizers have one group),
// created on first step; group options may be this adapter's DictOptions or the options of the
// LibTorch twin (torch::optim::AdamOptions, ...). Not thread-safe, like torch::optim.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_ADAPTER_H_
#define DTRAIN_OPTIM_FUNCTIONAL_ADAPTER_H_

#include <memory>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

#include "optim/functional/optimizer.h"

namespace dtrain::optim {

// Param-group options held as a PyTorch-style options dict.
class DictOptions : public torch::optim::OptimizerCloneableOptions<DictOptions> {
 public:
  explicit DictOptions(OptionsDict options = new_options_dict()) : options_(std::move(options)) {}
  DictOptions(const DictOptions& other) : options_(other.options_.copy()) {}
  DictOptions& operator=(const DictOptions& other) {
    options_ = other.options_.copy();
    return *this;
  }
  // REQUIRES an "lr" entry for get_lr.
  double get_lr() const override;
  void set_lr(const double lr) override;
  const OptionsDict& dict() const { return options_; }
  OptionsDict& dict() { return options_; }

 private:
  OptionsDict options_;
};

class FunctionalOptimizerAdapter : public torch::optim::Optimizer {
 public:
  // `name` is a registry name ("Adam", "SGD", a user's); `defaults` apply to every group that
  // brings no options of its own.
  FunctionalOptimizerAdapter(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                             std::string name, OptionsDict defaults);
  FunctionalOptimizerAdapter(std::vector<at::Tensor> params, std::string name,
                             OptionsDict defaults);

  // Evaluates `closure` (with autograd on) if given, then steps every group's functional
  // optimizer with the parameters' .grad() (undefined gradients skip their parameter).
  // Returns the closure's loss (undefined without a closure).
  at::Tensor step(LossClosure closure = nullptr) override;

  // PyTorch format over all groups: state by global parameter index (groups concatenated).
  c10::IValue state_dict();
  // Loads such a dict: as many groups as here, each with as many parameters, the groups' "params"
  // together holding each index 0..n-1 once; every group is checked as
  // FunctionalOptimizer::load_state_dict checks its one (step, slots, shapes, dtypes, finite
  // values, options) before any group changes. Errors (c10::Error, one line) name the key and
  // the parameter's index in the dict, or file_index[index] where given (ZeroRedundancyOptimizer
  // passes the file's index of each of its local parameters).
  void load_state_dict(const c10::IValue& state_dict);
  void load_state_dict(const c10::IValue& state_dict, const std::vector<int64_t>& file_index);

  const std::string& functional_name() const { return name_; }
  // The functional optimizer of group `group` (created on demand).
  FunctionalOptimizer& functional(size_t group);

 private:
  // The options each given group carried (null where none), kept before LibTorch takes the groups:
  // LibTorch 2.14's add_param_group replaces options of a type it does not know (DictOptions)
  // with the defaults, so the constructor puts the given ones back.
  using GivenOptions = std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>;
  static GivenOptions given_options(const std::vector<torch::optim::OptimizerParamGroup>& groups);
  FunctionalOptimizerAdapter(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                             GivenOptions given, std::string name, OptionsDict defaults);

  OptionsDict group_options(size_t group) const;
  void sync_groups();

  std::string name_;
  std::vector<std::unique_ptr<FunctionalOptimizer>> functionals_;
};

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_ADAPTER_H_
