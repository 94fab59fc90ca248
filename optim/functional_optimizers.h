// The eight functional optimizers of torch.distributed.optim, numerically PyTorch 1.13's
// single-tensor implementations: SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, RMSprop, Rprop.
// Options mirror PyTorch's keyword arguments and defaults, in LibTorch's chainable style.
//
//   using namespace dtrain::optim;
//   FunctionalSGD sgd(params, SGDOptions(0.1).momentum(0.9).nesterov(true));
//   FunctionalAdamW adamw(params, AdamWOptions().lr(3e-4).betas({0.9, 0.95}));
//   adamw.step(grads);                               // one optional gradient per parameter
//   adamw.set_options(AdamWOptions(adamw.options()).weight_decay(0.05));  // validated as at construction
//
// Contiguous float32/float64 parameters take a fused path: one multi-threaded pass per element
// over parameter, gradient and state for all parameters at once; other layouts and dtypes run
// the same math as ATen operations.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_OPTIMIZERS_H_
#define DTRAIN_OPTIM_FUNCTIONAL_OPTIMIZERS_H_

#include <tuple>

#include <torch/arg.h>

#include "optim/functional_optimizer.h"

namespace dtrain::optim {

// (first, second) option pairs: betas, etas, step_sizes.
using DoublePair = std::tuple<double, double>;

struct SGDOptions {
  explicit SGDOptions(double lr) : lr_(lr) {}  // lr has no default, as in PyTorch
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(bool, maximize) = false;
};

struct AdamOptions {
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(DoublePair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;
};

struct AdamWOptions {
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(DoublePair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;
};

struct AdagradOptions {
  TORCH_ARG(double, lr) = 1e-2;
  TORCH_ARG(double, lr_decay) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(double, initial_accumulator_value) = 0;
  TORCH_ARG(double, eps) = 1e-10;
  TORCH_ARG(bool, maximize) = false;
};

struct AdadeltaOptions {
  TORCH_ARG(double, lr) = 1.0;
  TORCH_ARG(double, rho) = 0.9;
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, maximize) = false;
};

struct AdamaxOptions {
  TORCH_ARG(double, lr) = 2e-3;
  TORCH_ARG(DoublePair, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, maximize) = false;
};

struct RMSpropOptions {
  TORCH_ARG(double, lr) = 1e-2;
  TORCH_ARG(double, alpha) = 0.99;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(bool, centered) = false;
  TORCH_ARG(bool, maximize) = false;
};

struct RpropOptions {
  TORCH_ARG(double, lr) = 1e-2;
  TORCH_ARG(DoublePair, etas) = std::make_tuple(0.5, 1.2);
  TORCH_ARG(DoublePair, step_sizes) = std::make_tuple(1e-6, 50.0);
  TORCH_ARG(bool, maximize) = false;
};

// Shared shape of the eight: typed options validated with PyTorch's messages at construction
// and on every set_options().
template <typename Options>
class TypedFunctionalOptimizer : public FunctionalOptimizer {
 public:
  TypedFunctionalOptimizer(std::vector<at::Tensor> params, Options options)
      : FunctionalOptimizer(std::move(params)), options_(std::move(options)) {}

  // `defaults` with `overrides` (PyTorch-named keys) applied and validated: how the registry
  // builds typed options from a dict before constructing (Adagrad's state depends on them).
  static Options resolve(const Options& defaults, const OptionsDict& overrides, const std::string& name) {
    Options o = from_dict(merged_options(name, to_dict(defaults), overrides));
    check(o);
    return o;
  }

  const Options& options() const { return options_; }
  void set_options(const Options& options) {
    check(options);
    options_ = options;
  }
  using FunctionalOptimizer::set_options;

  double lr() const override { return options_.lr(); }
  void set_lr(double lr) override {
    Options o = options_;
    o.lr(lr);
    set_options(o);
  }
  OptionsDict options_dict() const override { return to_dict(options_); }

 protected:
  void apply_options(const OptionsDict& merged) override { set_options(from_dict(merged)); }
  // Definitions per optimizer in functional_optimizers.cc.
  static void check(const Options& o);
  static OptionsDict to_dict(const Options& o);
  static Options from_dict(const OptionsDict& d);

  Options options_;
};

#define DTRAIN_DECLARE_FUNCTIONAL(Class, Options, Name)                                   \
  class Class : public TypedFunctionalOptimizer<Options> {                                \
   public:                                                                                \
    Class(std::vector<at::Tensor> params, Options options);                               \
    std::string name() const override { return Name; }                                   \
                                                                                          \
   protected:                                                                             \
    void update(size_t index, const at::Tensor& grad) override;                          \
    void update_all(const std::vector<at::Tensor>& grads) override;                       \
    StepKind step_kind() const override;                                                  \
    std::array<const char*, 4> slot_names() const override;                               \
    bool none_for_undefined_slots() const override;                                       \
  }

DTRAIN_DECLARE_FUNCTIONAL(FunctionalSGD, SGDOptions, "SGD");
DTRAIN_DECLARE_FUNCTIONAL(FunctionalAdam, AdamOptions, "Adam");
DTRAIN_DECLARE_FUNCTIONAL(FunctionalAdamW, AdamWOptions, "AdamW");
DTRAIN_DECLARE_FUNCTIONAL(FunctionalAdagrad, AdagradOptions, "Adagrad");
DTRAIN_DECLARE_FUNCTIONAL(FunctionalAdadelta, AdadeltaOptions, "Adadelta");
DTRAIN_DECLARE_FUNCTIONAL(FunctionalAdamax, AdamaxOptions, "Adamax");
DTRAIN_DECLARE_FUNCTIONAL(FunctionalRMSprop, RMSpropOptions, "RMSprop");
DTRAIN_DECLARE_FUNCTIONAL(FunctionalRprop, RpropOptions, "Rprop");

#undef DTRAIN_DECLARE_FUNCTIONAL

// The per-optimizer option functions are specialised in functional_optimizers.cc.
#define DTRAIN_DECLARE_OPTION_FUNCTIONS(Options)                                               \
  template <>                                                                                 \
  void TypedFunctionalOptimizer<Options>::check(const Options& o);                            \
  template <>                                                                                 \
  OptionsDict TypedFunctionalOptimizer<Options>::to_dict(const Options& o);                   \
  template <>                                                                                 \
  Options TypedFunctionalOptimizer<Options>::from_dict(const OptionsDict& d)
DTRAIN_DECLARE_OPTION_FUNCTIONS(SGDOptions);
DTRAIN_DECLARE_OPTION_FUNCTIONS(AdamOptions);
DTRAIN_DECLARE_OPTION_FUNCTIONS(AdamWOptions);
DTRAIN_DECLARE_OPTION_FUNCTIONS(AdagradOptions);
DTRAIN_DECLARE_OPTION_FUNCTIONS(AdadeltaOptions);
DTRAIN_DECLARE_OPTION_FUNCTIONS(AdamaxOptions);
DTRAIN_DECLARE_OPTION_FUNCTIONS(RMSpropOptions);
DTRAIN_DECLARE_OPTION_FUNCTIONS(RpropOptions);
#undef DTRAIN_DECLARE_OPTION_FUNCTIONS

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_OPTIMIZERS_H_
