// Functional optimizers: computation separated from state, as torch.distributed.optim's
// _FunctionalAdam & co. An optimizer owns a list of parameters (one parameter group) and their
// state; step() takes one optional gradient per parameter, so gradients can come from anywhere
// (DDP hooks, RPC gradient contexts, ZeRO shards) instead of `param.grad`.
//
//   std::vector<at::Tensor> params = {w, b};
//   dtrain::optim::FunctionalAdam adam(params, dtrain::optim::AdamOptions().lr(1e-3));
//   adam.step({grad_w, at::Tensor()});       // an undefined gradient leaves `b` and its state alone
//   adam.set_lr(adam.lr() * 0.5);            // options stay writable: schedulers work
//   c10::IValue sd = adam.state_dict();      // PyTorch's optimizer state_dict format
//
// Thread safety: an instance is not thread-safe, but instances share nothing (no global lock):
// independent optimizers may step concurrently on different threads.
#ifndef DTRAIN_OPTIM_FUNCTIONAL_OPTIMIZER_H_
#define DTRAIN_OPTIM_FUNCTIONAL_OPTIMIZER_H_

#include <array>
#include <string>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/optimizer_state_dict.h"

namespace dtrain::optim {

struct StatePrecision;  // optim/functional/state_precision.h

// A PyTorch param_group without "params": option name -> float, bool, (float, float) tuple,
// string or None, with PyTorch's key names ("lr", "betas", "weight_decay", ...).
using OptionsDict = c10::impl::GenericDict;

// An empty OptionsDict (string keys, any values).
OptionsDict new_options_dict();

// Per-parameter state, kept generically so state_dict/load_state_dict live in one place: a step
// counter and up to four tensors named by the optimizer's slot_names() (PyTorch's state keys).
// A slot has its parameter's shape unless slot_shape() says otherwise (NAdam's 0-dim mu_product,
// Adafactor's row_var and col_var).
struct ParamState {
  bool initialized = false;
  int64_t step = 0;
  std::array<at::Tensor, 4> slots;
  // The per-block absmax of each slot kept in 8 bits (state_dtype="8bit"), whose `slots` entry
  // then holds uint8 codes; undefined for every other slot (optim/functional/state_precision.h).
  std::array<at::Tensor, 4> scales;
  // The CUDA fused kernels' copy of `step`, as PyTorch's fused path keeps state["step"]: a 0-dim
  // float32 tensor on the parameter's device holding `device_step_value`. Undefined until a CUDA
  // fused step; rebuilt from `step` whenever the two differ (a loaded state, an ATen-path step),
  // so `step` stays the truth and nothing reads the device back. state_dict() writes `step`.
  at::Tensor device_step;
  int64_t device_step_value = -1;
};

// Where a state dict handed to FunctionalOptimizer::load_state_dict came from, for its messages:
// file_index[k] is the index the dict's parameter k has in the file (the adapter's index across
// its groups, ZeroRedundancyOptimizer's global one); empty: k itself. file_group: the file's param
// group that the optimizer's one group is.
struct StateDictSource {
  std::vector<int64_t> file_index;
  size_t file_group = 0;
};

class FunctionalOptimizer {
 public:
  // REQUIRES: params are defined, dense, distinct tensors. This base class accepts an empty list;
  // the built-in optimizers refuse one unless asked (PyTorch's _allow_empty_param_list, see
  // options.h), and a user's optimizer decides for itself.
  explicit FunctionalOptimizer(std::vector<at::Tensor> params);
  virtual ~FunctionalOptimizer();
  FunctionalOptimizer(const FunctionalOptimizer&) = delete;
  FunctionalOptimizer& operator=(const FunctionalOptimizer&) = delete;

  // PyTorch's class name of the twin optimizer ("Adam", "SGD", ...).
  virtual std::string name() const = 0;

  // One update. gradients.size() must equal params().size() (TORCH_CHECK naming both lengths);
  // an undefined entry skips that parameter and its state. Each gradient must match its
  // parameter's shape, dtype and device, and be dense (sparse COO for an optimizer whose
  // takes_sparse_gradients(), SparseAdam). Every gradient is checked before anything changes.
  // Runs without autograd recording.
  void step(const std::vector<at::Tensor>& gradients);

  // Updates one parameter (one of params(), by identity) with `grad`.
  void step_param(const at::Tensor& param, const at::Tensor& grad);

  const std::vector<at::Tensor>& params() const { return params_; }

  // The learning rate and the full option set, readable and writable between steps.
  virtual double lr() const = 0;
  virtual void set_lr(double lr) = 0;
  virtual OptionsDict options_dict() const = 0;
  // Every key set_options takes: options_dict() and, for the built-ins, the state-precision keys
  // (state_precision.h) that options_dict() leaves out while state_dtype is None.
  virtual OptionsDict all_options() const { return options_dict(); }
  // Validates every value (PyTorch's messages) before applying any. Unknown keys are an error;
  // PyTorch-only keys (foreach, capturable, differentiable, fused) are accepted when they ask for
  // nothing dtrain lacks. `fused` is an option of Adam, AdamW, SGD and Adagrad (None, the default,
  // or True: ATen's fused multi-tensor kernels for CUDA parameters; False: the per-tensor ATen
  // path there; CPU parameters take dtrain's own fused CPU kernels either way); the other
  // optimizers refuse fused=True. foreach is accepted and does not change the implementation.
  void set_options(const OptionsDict& options);
  // `current` with `overrides` applied, after checking every override key (see set_options);
  // `optimizer` names it in errors.
  static OptionsDict merged_options(const std::string& optimizer, OptionsDict current,
                                    const OptionsDict& overrides);

  // PyTorch's format (checkpoint/optimizer_state_dict.h): state {index: {name: tensor | int | None}},
  // one param group {options..., params: [0..n-1]}. State tensors are the live slots, on their
  // parameter's device; "step" is a 0-dim float32 CPU tensor for CUDA parameters too (PyTorch's
  // fused path keeps it on the device, and its load_state_dict moves a CPU one there), so that
  // saving reads nothing back from the GPU.
  c10::IValue state_dict() const;
  using StateDictSource = optim::StateDictSource;
  // Loads a state_dict of the format above (from dtrain, or converted from PyTorch/LibTorch):
  // exactly one param group whose "params" holds each of 0..params().size()-1 once. Everything is
  // checked before anything changes (optim/functional/state_checks.h): option types, PyTorch's
  // option checks and finite numbers; per parameter with state, "step" (a whole number >= 0) where
  // this optimizer counts steps, every slot a fresh state of it would have under the loaded
  // options (exp_avg and exp_avg_sq for Adam, ...), no unknown key, each tensor floating point,
  // of its slot_shape() (normally the parameter's) and finite. Tensors are cast to the
  // parameter's dtype and device, as PyTorch's Optimizer.load_state_dict does. Errors (c10::Error,
  // one line): "<Name>.load_state_dict: state 'step' of parameter 3 is nan, ...; load a state dict
  // ...", naming the key and the parameter's index in the file.
  // Param-group keys this optimizer does not use (an LR scheduler's "initial_lr", PyTorch 2.x's
  // "foreach"/"maximize"/..., a user's own) are kept and handed back by state_dict(), as PyTorch
  // keeps them; set_options() still refuses an unknown key (a typo there is an error).
  void load_state_dict(const c10::IValue& state_dict);
  void load_state_dict(const c10::IValue& state_dict, const StateDictSource& source);
  // What load_state_dict checks, changing nothing: OK, or InvalidArgument with its message.
  absl::Status check_state_dict(const c10::IValue& state_dict,
                                const StateDictSource& source = {}) const;
  // One parameter's state entry against `param` (shaped as a parameter of this optimizer, not
  // necessarily one of params(): ZeroRedundancyOptimizer checks every rank's parameters) under
  // the loaded param group's options `group_options` (keys this optimizer does not use ignored;
  // the others checked as load_state_dict would apply them), the file's param_groups[file_group].
  // InvalidArgument naming `file_index` (or the group, for an option).
  absl::Status check_state_entry(const checkpoint::StateEntry& entry, const at::Tensor& param,
                                 int64_t file_index, const OptionsDict& group_options,
                                 size_t file_group = 0) const;

  // True once the parameter at `index` has optimizer state.
  bool has_state(size_t index) const;

  // How "step" appears in PyTorch's state dict (see step_kind()).
  enum class StepKind {
    kNone,         // no "step" entry (SGD)
    kInt,          // Python int (SparseAdam)
    kFloatTensor,  // 0-dim float32 tensor (the others: PyTorch 2.x's format)
  };

  // Whether step() takes sparse COO gradients (and only those: SparseAdam) instead of dense ones.
  virtual bool takes_sparse_gradients() const { return false; }

 protected:
  // Updates params()[index] with a checked gradient. Called with autograd off.
  virtual void update(size_t index, const at::Tensor& grad) = 0;
  // All parameters at once (entries may be undefined). The default calls update() per parameter;
  // optimizers with a fused multi-tensor path override it.
  virtual void update_all(const std::vector<at::Tensor>& grads);
  // Builds new options from `merged` (every key of all_options() present), validates them
  // with PyTorch's messages (c10::Error) and only then replaces the current ones.
  virtual void apply_options(const OptionsDict& merged) = 0;

  virtual StepKind step_kind() const = 0;
  // Names of the slots; an empty name ends the list. An undefined slot tensor is left out of the
  // state dict, unless none_for_undefined_slots() (SGD writes momentum_buffer=None).
  virtual std::array<const char*, 4> slot_names() const = 0;
  virtual bool none_for_undefined_slots() const { return false; }
  // Which slots hold signed values (an 8-bit slot's quantisation map; state_precision.h).
  virtual std::array<bool, 4> signed_slots() const { return {true, true, true, true}; }
  // Which slots are 0-dim scalars kept in float32 whatever the state precision (NAdam's
  // mu_product, ASGD's eta and mu).
  virtual std::array<bool, 4> scalar_slots() const { return {}; }
  // The shape of slot `slot` for `param`; load_state_dict() checks loaded tensors against it and
  // casts them to the parameter's dtype and device, as PyTorch's Optimizer.load_state_dict does.
  virtual std::vector<int64_t> slot_shape(size_t slot, const at::Tensor& param) const {
    return param.sizes().vec();
  }
  // The dtype the update of `param` runs in under the full options `merged`, which state kept
  // at state_dtype=None is loaded as: the parameter's, or float32 for a bfloat16 parameter of
  // Adam or AdamW with param_remainders (its float32 master weight).
  virtual at::ScalarType update_dtype(const at::Tensor& param, const OptionsDict& merged) const {
    return param.scalar_type();
  }
  // The slots a loaded entry for `param` must have under the full options `merged`
  // (all_options()'s keys): those the update takes as there once a parameter has state. The
  // default (a user's optimizer): none.
  virtual std::array<bool, 4> required_slots(const at::Tensor& param,
                                             const OptionsDict& merged) const {
    return {};
  }
  // Validates the full options `merged` without applying them (c10::Error with PyTorch's
  // message). The default: nothing (apply_options checks them when load_state_dict applies them).
  virtual void check_options(const OptionsDict& merged) const {}

  std::vector<at::Tensor> params_;
  std::vector<ParamState> state_;

 private:
  // Param-group keys load_state_dict() kept without using them (see there), in load order.
  std::vector<std::pair<std::string, c10::IValue>> kept_group_keys_;

  // A checked state dict, ready to replace the current state and options (load_state_dict's two
  // halves; the adapter checks every group before it commits any).
  struct Loaded {
    OptionsDict options = new_options_dict();  // for set_options
    std::vector<std::pair<std::string, c10::IValue>> kept;
    std::vector<ParamState> state;
  };
  friend class FunctionalOptimizerAdapter;
  absl::StatusOr<Loaded> build_loaded(const c10::IValue& state_dict,
                                      const StateDictSource& source) const;
  void commit_loaded(Loaded loaded);
  // The group's options split into what set_options takes and the keys kept unused, and the full
  // options they make (options_dict() with them applied), checked. InvalidArgument on error.
  absl::Status loaded_options(const OptionsDict& group_options, size_t file_group,
                              OptionsDict* options,
                              std::vector<std::pair<std::string, c10::IValue>>* kept,
                              OptionsDict* merged) const;
  // One entry checked and (with `copy`) converted; InvalidArgument naming `file_index`.
  absl::StatusOr<ParamState> entry_state(const checkpoint::StateEntry& entry,
                                         const at::Tensor& param, int64_t file_index,
                                         const OptionsDict& merged, bool copy) const;

  // One slot of a loaded entry (its value, or an 8-bit slot's codes and scales, as the entry has
  // them) checked and, with `copy`, kept in *s at `precision`. InvalidArgument naming the key.
  absl::Status load_slot(const c10::IValue* value, const c10::IValue* codes,
                         const c10::IValue* absmax, size_t slot, const at::Tensor& param,
                         int64_t file_index, const StatePrecision& precision, bool copy,
                         ParamState* s) const;

  void check_grad(size_t index, const at::Tensor& grad) const;
};

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_OPTIMIZER_H_
