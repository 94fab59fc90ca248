// Typed options for functional optimizers, described once: an OptionTable lists an optimizer's
// PyTorch keys in the order of PyTorch's param_group dict, each bound to a field of a
// TORCH_ARG-style options struct and to PyTorch's check of it. Validation, the options dict
// (to_dict / from_dict), the registry's factory and its error messages all come from the table.
//
//   OptionTable<AdamOptions>("Adam", AdamOptions())   // PyTorch's name, the registry's defaults
//       .lr().betas().eps().weight_decay()             // rows most optimizers share
//       .option(DTRAIN_OPTION(amsgrad))                 // a row of its own (no check)
//       .option(DTRAIN_OPTION(rho), in_unit_interval("Invalid rho value"))   // (a checked one)
//       .maximize().foreach().fixed("capturable", false);
//
// The defaults are the struct's (TORCH_ARG(double, lr) = 1e-3, in functional_<name>.h, as LibTorch
// declares its options); the table's `defaults` are where the registry starts, normally the same.
// Each built-in's table is in its functional_<name>.cc (Descriptor<Options>::options()).
//
// TypedFunctionalOptimizer<Options> is the built-in optimizers' class: FunctionalAdam is
// TypedFunctionalOptimizer<AdamOptions>. Thread safety: tables are immutable once built.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_OPTIONS_H_
#define DTRAIN_OPTIM_FUNCTIONAL_OPTIONS_H_

#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "optim/functional/optimizer.h"
#include "optim/functional/state_precision.h"

namespace dtrain::optim {

// (first, second) option pairs: betas, etas, step_sizes.
using DoublePair = std::tuple<double, double>;
// Adafactor's eps: (eps1 or None, eps2).
using OptionalDoublePair = std::tuple<std::optional<double>, double>;
// Muon's ns_coefficients (a, b, c).
using DoubleTriple = std::tuple<double, double, double>;
// A string or None (Muon's adjust_lr_fn).
using OptionalString = std::optional<std::string>;
// True, False or None (`fused`).
using OptionalBool = std::optional<bool>;

// Python's repr of a float, for PyTorch's error messages ("Invalid learning rate: -0.1").
std::string python_float_repr(double v);

// One option's value read from a dict (TORCH_CHECK naming the key when its type is wrong; an int
// is taken as a float) and written to one.
double option_value(const OptionsDict& d, const std::string& key, double*);
bool option_value(const OptionsDict& d, const std::string& key, bool*);
DoublePair option_value(const OptionsDict& d, const std::string& key, DoublePair*);
int64_t option_value(const OptionsDict& d, const std::string& key,
                     int64_t*);  // an int (or an integral float)
OptionalDoublePair option_value(const OptionsDict& d, const std::string& key, OptionalDoublePair*);
DoubleTriple option_value(const OptionsDict& d, const std::string& key, DoubleTriple*);
OptionalString option_value(const OptionsDict& d, const std::string& key, OptionalString*);
OptionalBool option_value(const OptionsDict& d, const std::string& key, OptionalBool*);
c10::IValue option_ivalue(double v);
c10::IValue option_ivalue(bool v);
c10::IValue option_ivalue(const DoublePair& v);
c10::IValue option_ivalue(int64_t v);
c10::IValue option_ivalue(const OptionalDoublePair& v);
c10::IValue option_ivalue(const DoubleTriple& v);
c10::IValue option_ivalue(const OptionalString& v);
c10::IValue option_ivalue(const OptionalBool& v);

// The state-precision options of every built-in optimizer (optim/functional/state_precision.h):
// state_dtype None (the parameter's dtype, PyTorch's), "bfloat16" or "8bit" (the Adam family);
// state_stochastic_rounding (bfloat16: stochastic, the default, or to nearest); state_seed (the
// stochastic rounding's key). A field of every built-in's options struct.
#define DTRAIN_STATE_PRECISION_ARGS                      \
  TORCH_ARG(OptionalString, state_dtype) = std::nullopt; \
  TORCH_ARG(bool, state_stochastic_rounding) = true;     \
  TORCH_ARG(int64_t, state_seed) = 0

// PyTorch's check of one value: returns, or throws c10::Error with PyTorch's message.
template <typename T>
using OptionRule = std::function<void(const T&)>;
// v >= 0, else "<what>: <v>" ("Invalid learning rate: -0.1").
OptionRule<double> non_negative(const char* what);
// 0 <= v <= 1, else "<what>: <v>".
OptionRule<double> in_unit_interval(const char* what);
// 0 <= beta < 1 for both, else "Invalid beta parameter at index <i>: <beta>".
OptionRule<DoublePair> valid_betas();

// `name, accessor` for OptionTable::option: the PyTorch key equals the options struct's field.
#define DTRAIN_OPTION(field) \
#field, [](auto& o) -> auto& { return o.field(); }

template <typename Options>
class OptionTable {
 public:
  // `name`: PyTorch's class name ("Adam"), used in messages and as the registry name.
  // `defaults`: what the registry's factory starts from (usually Options()).
  OptionTable(std::string name, Options defaults)
      : name_(std::move(name)), defaults_(std::move(defaults)) {}

  // A key backed by a field (`accessor(options)` returns a reference to it), checked by `rule`.
  template <typename Accessor>
  OptionTable& option(
      const char* key, Accessor accessor,
      OptionRule<std::decay_t<decltype(std::declval<Accessor&>()(std::declval<Options&>()))>> rule =
          {}) {
    using T = std::decay_t<decltype(accessor(std::declval<Options&>()))>;
    Row row;
    row.key = key;
    row.get = [accessor](const Options& o) { return option_ivalue(accessor(o)); };
    row.set = [accessor, k = row.key](Options& o, const OptionsDict& d) {
      accessor(o) = option_value(d, k, static_cast<T*>(nullptr));
    };
    if (rule) row.check = [accessor, rule](const Options& o) { rule(accessor(o)); };
    rows_.push_back(std::move(row));
    return *this;
  }
  // A PyTorch key dtrain reports with a fixed value (foreach=None, capturable=False, ...): which
  // values set_options accepts for it is FunctionalOptimizer::merged_options' business.
  OptionTable& fixed(const char* key, c10::IValue value) {
    Row row;
    row.key = key;
    row.fixed = std::move(value);
    rows_.push_back(std::move(row));
    return *this;
  }
  // A check over several options (SGD's nesterov), run after the per-key ones.
  OptionTable& check(std::function<void(const Options&)> rule) {
    cross_checks_.push_back(std::move(rule));
    return *this;
  }
  // Keys the registry's caller must give (PyTorch's SGD has no default lr).
  OptionTable& required(const char* key) {
    required_.emplace_back(key);
    return *this;
  }
  // The order PyTorch checks the keys in, where it differs from the dict's (the first failing
  // check is the one reported); unlisted keys are checked afterwards, in dict order.
  OptionTable& check_order(std::vector<std::string> keys) {
    check_order_ = std::move(keys);
    return *this;
  }

  // The rows most optimizers share, with PyTorch's checks and messages.
  OptionTable& lr() { return option(DTRAIN_OPTION(lr), non_negative("Invalid learning rate")); }
  OptionTable& eps() { return option(DTRAIN_OPTION(eps), non_negative("Invalid epsilon value")); }
  OptionTable& weight_decay() {
    return option(DTRAIN_OPTION(weight_decay), non_negative("Invalid weight_decay value"));
  }
  OptionTable& betas() { return option(DTRAIN_OPTION(betas), valid_betas()); }
  OptionTable& maximize() { return option(DTRAIN_OPTION(maximize)); }
  OptionTable& foreach () { return fixed("foreach", c10::IValue()); }
  // PyTorch's `fused` (None, True or False), backed by Options::fused(): which CUDA path the
  // optimizers with ATen fused kernels take (see FunctionalOptimizer::set_options).
  OptionTable& fused() { return option(DTRAIN_OPTION(fused)); }
  OptionTable& differentiable() { return fixed("differentiable", false); }
  // A dtrain-only bool option (Adam's param_remainders): in to_dict() only while true (or `all`),
  // so a default optimizer's param_group has PyTorch's keys exactly; a loaded group without it
  // keeps the loading optimizer's value (state_precision.h's is_dtrain_option).
  template <typename Accessor>
  OptionTable& dtrain_flag(const char* key, Accessor accessor) {
    option(key, accessor);
    rows_.back().omit_false = true;
    return *this;
  }
  // The three state-precision rows (DTRAIN_STATE_PRECISION_ARGS) and their check; `allow_8bit`:
  // whether the optimizer has 8-bit state. TypedFunctionalOptimizer appends them to every
  // built-in's table; state_dict() leaves them out while state_dtype is None, so a default
  // optimizer's param_group has PyTorch's keys exactly.
  OptionTable& state_precision(bool allow_8bit) {
    const size_t first = rows_.size();
    option(DTRAIN_OPTION(state_dtype));
    option(DTRAIN_OPTION(state_stochastic_rounding));
    option(DTRAIN_OPTION(state_seed));
    for (size_t i = first; i < rows_.size(); ++i) rows_[i].precision = true;
    default_precision_ = [](const Options& o) { return !o.state_dtype().has_value(); };
    return check([name = name_, allow_8bit](const Options& o) {
      parse_state_precision(name, o.state_dtype(), o.state_stochastic_rounding(), o.state_seed(),
                            allow_8bit);
    });
  }

  const std::string& name() const { return name_; }
  const Options& defaults() const { return defaults_; }

  // PyTorch's checks, in PyTorch's order; c10::Error with PyTorch's message.
  void validate(const Options& o) const {
    std::vector<bool> done(rows_.size(), false);
    for (const std::string& key : check_order_) {
      for (size_t i = 0; i < rows_.size(); ++i) {
        if (rows_[i].key == key && !done[i]) {
          if (rows_[i].check) rows_[i].check(o);
          done[i] = true;
        }
      }
    }
    for (size_t i = 0; i < rows_.size(); ++i) {
      if (!done[i] && rows_[i].check) rows_[i].check(o);
    }
    for (const auto& rule : cross_checks_) rule(o);
  }
  // Every key, in PyTorch's param_group order; the state-precision keys only while state_dtype is
  // set, unless `all` (the keys set_options takes).
  OptionsDict to_dict(const Options& o, bool all = false) const {
    OptionsDict d = new_options_dict();
    const bool omit = !all && default_precision_ && default_precision_(o);
    for (const Row& row : rows_) {
      if (omit && row.precision) continue;
      const c10::IValue v = row.get ? row.get(o) : row.fixed;
      if (row.omit_false && !all && !v.toBool()) continue;
      d.insert(row.key, v);
    }
    return d;
  }
  // `base` with every field-backed key of `d` (which must have them all) applied; not validated.
  Options from_dict(const OptionsDict& d, Options base) const {
    for (const Row& row : rows_) {
      if (row.set) row.set(base, d);
    }
    return base;
  }
  // The registry's options: defaults() with `overrides` (PyTorch-named keys, as set_options
  // takes them) applied, then validated.
  Options resolve(const OptionsDict& overrides) const {
    for (const std::string& key : required_) {
      TORCH_CHECK(overrides.contains(key), name_, " needs an '", key,
                  "' option (it has no default)");
    }
    Options o = from_dict(
        FunctionalOptimizer::merged_options(name_, to_dict(defaults_, /*all=*/true), overrides),
        defaults_);
    validate(o);
    return o;
  }

 private:
  struct Row {
    std::string key;
    std::function<c10::IValue(const Options&)> get;         // null for a fixed key
    std::function<void(Options&, const OptionsDict&)> set;  // null for a fixed key
    std::function<void(const Options&)> check;              // null when unchecked
    c10::IValue fixed;
    bool precision = false;   // a state-precision key (see to_dict)
    bool omit_false = false;  // a dtrain_flag (see to_dict)
  };

  std::string name_;
  Options defaults_;
  std::vector<Row> rows_;
  std::vector<std::function<void(const Options&)>> cross_checks_;
  std::vector<std::string> required_;
  std::vector<std::string> check_order_;
  std::function<bool(const Options&)> default_precision_;  // state_dtype None
};

// A built-in functional optimizer with options of type `Options` (FunctionalAdam is
// TypedFunctionalOptimizer<AdamOptions>): options validated with PyTorch's messages at
// construction and on every set_options(); the update runs the fused kernels where it can (see
// internal/optimizer_impl.h). Defined, per optimizer, in <name>.cc.
template <typename Options>
class TypedFunctionalOptimizer : public FunctionalOptimizer {
 public:
  using OptionsType = Options;

  // Errors: PyTorch's message for an invalid option; "optimizer got an empty parameter list"
  // when `params` is empty, unless allow_empty_param_list (PyTorch's _allow_empty_param_list,
  // which ZeroRedundancyOptimizer passes: a rank may own no parameter).
  TypedFunctionalOptimizer(std::vector<at::Tensor> params, Options options,
                           bool allow_empty_param_list = false);

  // Name, keys, checks and registry defaults of this optimizer's options.
  static const OptionTable<Options>& option_table();
  // Whether the update needs each parameter whole, in its shape (Adafactor, Muon): see
  // FunctionalRegistry::needs_whole_parameters.
  static bool needs_whole_parameters();

  const Options& options() const { return options_; }
  void set_options(const Options& options) {
    option_table().validate(options);
    options_ = options;
  }
  using FunctionalOptimizer::set_options;

  std::string name() const override { return option_table().name(); }
  double lr() const override { return options_.lr(); }
  void set_lr(double lr) override {
    Options o = options_;
    o.lr(lr);
    set_options(o);
  }
  OptionsDict options_dict() const override { return option_table().to_dict(options_); }
  OptionsDict all_options() const override { return option_table().to_dict(options_, true); }

 protected:
  void update(size_t index, const at::Tensor& grad) override;
  void update_all(const std::vector<at::Tensor>& grads) override;
  void apply_options(const OptionsDict& merged) override {
    set_options(option_table().from_dict(merged, options_));
  }
  StepKind step_kind() const override;
  std::array<const char*, 4> slot_names() const override;
  bool none_for_undefined_slots() const override;
  std::array<bool, 4> signed_slots() const override;
  std::array<bool, 4> scalar_slots() const override;
  std::vector<int64_t> slot_shape(size_t slot, const at::Tensor& param) const override;
  bool takes_sparse_gradients() const override;
  // The descriptor's own lazy initialisation, run on a meta tensor of the parameter's shape (no
  // memory): the slots its first update creates, less those an update creates whenever they are
  // missing (SGD's momentum_buffer, None in PyTorch 1.13's files), are what a loaded entry must
  // hold.
  std::array<bool, 4> required_slots(const at::Tensor& param,
                                     const OptionsDict& merged) const override;
  at::ScalarType update_dtype(const at::Tensor& param, const OptionsDict& merged) const override;
  void check_options(const OptionsDict& merged) const override {
    option_table().validate(option_table().from_dict(merged, options_));
  }

  Options options_;
};

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_OPTIONS_H_
