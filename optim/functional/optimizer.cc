#include "optim/functional/optimizer.h"

#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/optimizer_state_dict.h"
#include "optim/functional/state_checks.h"
#include "optim/functional/state_precision.h"
#include "optim/functional/torch_load_defaults.h"

namespace dtrain::optim {

namespace {

// The state precision the full options `merged` ask for (the parameter's dtype for an optimizer
// without the state-precision options: a user's).
StatePrecision precision_in(const std::string& optimizer, const OptionsDict& merged) {
  if (!merged.contains(kStateDtypeKey)) return {};
  const c10::IValue dtype = merged.at(kStateDtypeKey);
  std::optional<std::string> state_dtype;
  if (dtype.isString()) state_dtype = dtype.toStringRef();
  const c10::IValue rounding = merged.contains(kStateStochasticRoundingKey)
                                   ? merged.at(kStateStochasticRoundingKey)
                                   : c10::IValue(true);
  const c10::IValue seed =
      merged.contains(kStateSeedKey) ? merged.at(kStateSeedKey) : c10::IValue(0);
  return parse_state_precision(optimizer, state_dtype, !rounding.isBool() || rounding.toBool(),
                               seed.isInt() ? seed.toInt() : 0, /*allow_8bit=*/true);
}

}  // namespace

OptionsDict new_options_dict() { return OptionsDict(c10::StringType::get(), c10::AnyType::get()); }

FunctionalOptimizer::FunctionalOptimizer(std::vector<at::Tensor> params)
    : params_(std::move(params)) {
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(params_[i].defined(), "functional optimizer: parameter ", i, " is undefined");
    TORCH_CHECK(params_[i].layout() == at::kStrided, "functional optimizer: parameter ", i,
                " is sparse; functional optimizers take dense parameters");
    TORCH_CHECK(seen.insert(params_[i].unsafeGetTensorImpl()).second,
                "functional optimizer: parameter ", i,
                " appears more than once in the parameter list");
  }
  state_.resize(params_.size());
}

FunctionalOptimizer::~FunctionalOptimizer() = default;

void FunctionalOptimizer::check_grad(size_t index, const at::Tensor& grad) const {
  const at::Tensor& p = params_[index];
  if (takes_sparse_gradients()) {
    // PyTorch's message, then what dtrain expects instead.
    TORCH_CHECK(
        grad.is_sparse(), name(),
        " does not support dense gradients, please consider Adam instead (gradient ", index,
        " is dense; pass a sparse COO gradient, such as nn.Embedding(sparse=True) produces)");
  } else {
    TORCH_CHECK(grad.layout() == at::kStrided, name(), ": gradient ", index,
                " is sparse; this optimizer does not support sparse gradients");
  }
  TORCH_CHECK(grad.sizes() == p.sizes(), name(), ": gradient ", index, " has shape ", grad.sizes(),
              " but its parameter has shape ", p.sizes());
  TORCH_CHECK(grad.scalar_type() == p.scalar_type(), name(), ": gradient ", index, " is ",
              grad.scalar_type(), " but its parameter is ", p.scalar_type());
  TORCH_CHECK(grad.device() == p.device(), name(), ": gradient ", index, " is on ", grad.device(),
              " but its parameter is on ", p.device());
}

void FunctionalOptimizer::step(const std::vector<at::Tensor>& gradients) {
  TORCH_CHECK(
      gradients.size() == params_.size(),
      "the gradients passed in does not equal to the size of the parameters! Params length: ",
      params_.size(), ". Gradients length: ", gradients.size());
  for (size_t i = 0; i < gradients.size(); ++i) {
    if (gradients[i].defined()) check_grad(i, gradients[i]);
  }
  c10::NoGradGuard no_grad;
  update_all(gradients);
}

void FunctionalOptimizer::step_param(const at::Tensor& param, const at::Tensor& grad) {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].is_same(param)) {
      if (!grad.defined()) return;
      check_grad(i, grad);
      c10::NoGradGuard no_grad;
      update(i, grad);
      return;
    }
  }
  TORCH_CHECK(false, name(), ": step_param got a tensor that is not one of this optimizer's ",
              params_.size(), " parameters");
}

void FunctionalOptimizer::update_all(const std::vector<at::Tensor>& grads) {
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined()) update(i, grads[i]);
  }
}

bool FunctionalOptimizer::has_state(size_t index) const {
  TORCH_CHECK(index < state_.size(), "parameter index ", index, " out of range (", state_.size(),
              ")");
  return state_[index].initialized;
}

namespace {
// PyTorch options that pick an implementation or a CUDA/autograd feature, not the math.
bool is_torch_only_option(const std::string& key) {
  static const std::unordered_set<std::string> torch_only = {"foreach", "capturable",
                                                             "differentiable", "fused"};
  return torch_only.count(key) > 0;
}
}  // namespace

OptionsDict FunctionalOptimizer::merged_options(const std::string& optimizer, OptionsDict current,
                                                const OptionsDict& overrides) {
  for (const auto& kv : overrides) {
    const std::string key = kv.key().toStringRef();
    if (is_torch_only_option(key)) {
      const c10::IValue& v = kv.value();
      // `fused` is a real option where the optimizer's table has it (Adam, AdamW, SGD, Adagrad:
      // ATen's fused CUDA kernels); elsewhere, as foreach, it only picks PyTorch's implementation.
      if (key == "fused" && current.contains(key)) {
        TORCH_CHECK(v.isNone() || v.isBool(), optimizer,
                    ": option fused must be True, False or None, got ", v.tagKind());
        current.insert_or_assign(key, v);
        continue;
      }
      TORCH_CHECK(key != "fused" || v.isNone() || (v.isBool() && !v.toBool()), optimizer,
                  ": option fused=True is not supported: dtrain has ATen's fused CUDA kernels for "
                  "Adam, AdamW, "
                  "SGD and Adagrad only (",
                  optimizer,
                  " runs its own fused CPU kernel where it can); leave it "
                  "None or False");
      // foreach only picks PyTorch's implementation; the others change semantics we do not have.
      TORCH_CHECK(key == "foreach" || v.isNone() || (v.isBool() && !v.toBool()), optimizer,
                  ": option ", key,
                  "=True is not supported (CUDA-graph / autograd-through-step "
                  "features of PyTorch); leave it False");
      continue;
    }
    if (!current.contains(key)) {
      std::string names;
      for (const auto& m : current) names += (names.empty() ? "" : ", ") + m.key().toStringRef();
      TORCH_CHECK(false, optimizer, " got an unexpected option '", key,
                  "'; its options are: ", names);
    }
    current.insert_or_assign(key, kv.value());
  }
  return current;
}

void FunctionalOptimizer::set_options(const OptionsDict& options) {
  apply_options(merged_options(name(), all_options(), options));
}

c10::IValue FunctionalOptimizer::state_dict() const {
  checkpoint::OptimizerStateDict sd;
  const auto names = slot_names();
  // Low-precision state of an optimizer that counts no steps keeps the count its rounding uses.
  const bool low = precision_in(name(), all_options()).dtype != StateDtype::kParam;
  for (size_t i = 0; i < state_.size(); ++i) {
    const ParamState& s = state_[i];
    if (!s.initialized) continue;
    checkpoint::StateEntry entry = checkpoint::new_state_entry();
    if (step_kind() == StepKind::kInt) entry.insert("step", s.step);
    if (step_kind() == StepKind::kFloatTensor || (step_kind() == StepKind::kNone && low)) {
      entry.insert("step", at::scalar_tensor(static_cast<double>(s.step), at::kFloat));
    }
    for (size_t k = 0; k < names.size() && names[k] != nullptr && names[k][0] != '\0'; ++k) {
      if (s.slots[k].defined() && s.scales[k].defined()) {  // 8-bit (state_precision.h)
        entry.insert(std::string(names[k]) + kCodesSuffix, s.slots[k]);
        entry.insert(std::string(names[k]) + kAbsmaxSuffix, s.scales[k]);
      } else if (s.slots[k].defined()) {
        entry.insert(names[k], s.slots[k]);
      } else if (none_for_undefined_slots()) {
        entry.insert(names[k], c10::IValue());
      }
    }
    // PyTorch 2.x's SGD without momentum keeps no state at all (1.13 keeps momentum_buffer=None).
    if (entry.size() > 0) sd.state.emplace(static_cast<int64_t>(i), entry);
  }
  checkpoint::ParamGroup group;
  group.options = options_dict();
  for (const auto& [key, value] : kept_group_keys_) {
    if (!group.options.contains(key)) group.options.insert(key, value);
  }
  for (size_t i = 0; i < params_.size(); ++i) group.params.push_back(static_cast<int64_t>(i));
  sd.param_groups.push_back(std::move(group));
  return checkpoint::to_ivalue(sd);
}

namespace {

// The file's index of the dict's parameter `k`.
int64_t file_index_of(const FunctionalOptimizer::StateDictSource& source, int64_t k) {
  if (source.file_index.empty()) return k;
  return k >= 0 && k < static_cast<int64_t>(source.file_index.size())
             ? source.file_index[static_cast<size_t>(k)]
             : k;
}

absl::Status invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

// "step, exp_avg, exp_avg_sq, max_exp_avg_sq": the state keys an optimizer keeps.
std::string known_keys(const std::array<const char*, 4>& names, bool step) {
  std::vector<std::string> keys;
  if (step) keys.emplace_back("step");
  for (const char* n : names) {
    if (n != nullptr && n[0] != '\0') keys.emplace_back(n);
  }
  return absl::StrJoin(keys, ", ");
}

// One slot of a loaded entry: its values, or (8-bit) its codes and scales.
struct LoadedSlot {
  const c10::IValue* value = nullptr;
  const c10::IValue* codes = nullptr;
  const c10::IValue* absmax = nullptr;
};

}  // namespace

absl::Status FunctionalOptimizer::loaded_options(
    const OptionsDict& group_options, size_t file_group, OptionsDict* options,
    std::vector<std::pair<std::string, c10::IValue>>* kept, OptionsDict* merged) const {
  const std::string what = name() + ".load_state_dict";
  const OptionsDict known = all_options();
  for (const auto& kv : group_options) {
    const std::string& key = kv.key().toStringRef();
    if (!known.contains(key)) kept->emplace_back(key, kv.value());
    if (known.contains(key) || is_torch_only_option(key)) options->insert(kv.key(), kv.value());
  }
  // PyTorch replaces the whole group: an option the group lacks takes PyTorch's load default
  // (__setstate__'s setdefault), never this optimizer's current value, or is refused where
  // PyTorch has none (its next step would raise KeyError). The state-precision options are
  // dtrain's: a group without them (PyTorch's) keeps this optimizer's precision.
  for (const auto& kv : known) {
    const std::string& key = kv.key().toStringRef();
    if (group_options.contains(key) || is_dtrain_option(key)) continue;
    std::optional<c10::IValue> fallback = torch_load_default(name(), key);
    if (!fallback.has_value()) {
      return invalid(absl::StrCat(
          what, ": param_groups[", file_group, "] has no '", key, "' (PyTorch's ", name(),
          " cannot step without it: its state dicts always have it); ", kLoadAdvice));
    }
    options->insert(key, *fallback);
  }
  try {
    *merged = merged_options(name(), known, *options);
    check_options(*merged);
  } catch (const c10::Error& e) {
    // PyTorch's message names the check ("Invalid learning rate: -1.0"); the key that fails it
    // alone is named too.
    std::string key;
    for (const auto& kv : *options) {
      OptionsDict one = new_options_dict();
      one.insert(kv.key(), kv.value());
      try {
        check_options(merged_options(name(), known, one));
      } catch (const c10::Error&) {
        key = absl::StrCat("['", kv.key().toStringRef(), "']");
        break;
      }
    }
    return invalid(absl::StrCat(what, ": param_groups[", file_group, "]", key, ": ",
                                e.what_without_backtrace(), "; ", kLoadAdvice));
  }
  return absl::OkStatus();
}

absl::Status FunctionalOptimizer::load_slot(const c10::IValue* value, const c10::IValue* codes,
                                            const c10::IValue* absmax, size_t slot,
                                            const at::Tensor& param, int64_t file_index,
                                            const StatePrecision& precision, bool copy,
                                            ParamState* s) const {
  const std::string what = name() + ".load_state_dict";
  const std::string key = slot_names()[slot];
  const std::vector<int64_t> shape = slot_shape(slot, param);
  const bool is_signed = signed_slots()[slot], scalar = scalar_slots()[slot];
  at::Tensor values;
  if (codes != nullptr || absmax != nullptr) {
    auto fail = [&](const std::string& problem) {
      return state_error(what, key, file_index, invalid(problem));
    };
    if (value != nullptr) return fail(absl::StrCat("is there both as values and as 8-bit codes"));
    if (codes == nullptr || absmax == nullptr) {
      return fail(absl::StrCat("has ",
                               codes == nullptr ? "_absmax but no _codes" : "_codes but no _absmax",
                               " (an 8-bit slot is saved as both)"));
    }
    if (!codes->isTensor() || !absmax->isTensor())
      return fail("has _codes or _absmax not a tensor");
    const at::Tensor& c = codes->toTensor();
    const at::Tensor& a = absmax->toTensor();
    if (absl::Status ok = check_8bit_slot(c, a, shape); !ok.ok()) {
      return state_error(what, key, file_index, ok);
    }
    if (!copy) {
      s->slots[slot] = c;
      s->scales[slot] = a;
      return absl::OkStatus();
    }
    if (precision.dtype == StateDtype::k8Bit && !scalar) {  // kept as saved: resumes bit for bit
      s->slots[slot] = c.to(param.device()).clone();
      s->scales[slot] = a.to(param.device(), at::kFloat).clone();
      return absl::OkStatus();
    }
    values = dequantize8({c, a.to(at::kFloat)}, is_signed, param.scalar_type()).to(param.device());
  } else {
    if (value->isNone()) return absl::OkStatus();  // as never created (SGD's momentum_buffer=None)
    if (!value->isTensor()) {
      return state_error(what, key, file_index,
                         invalid(absl::StrCat("is a ", value->tagKind(), ", not a tensor")));
    }
    const at::Tensor& t = value->toTensor();
    if (absl::Status ok = check_state_tensor(t, param, shape, name()); !ok.ok()) {
      return state_error(what, key, file_index, ok);
    }
    if (!copy) {
      s->slots[slot] = t;
      return absl::OkStatus();
    }
    if (precision.dtype == StateDtype::kBFloat16 && t.scalar_type() == at::kBFloat16 && !scalar) {
      s->slots[slot] = t.to(param.device()).clone();
      return absl::OkStatus();
    }
    // PyTorch casts every state tensor but "step" to its parameter's dtype and device.
    values = at::empty(shape, param.options()).copy_(t);
  }
  if (scalar || precision.dtype == StateDtype::kParam) {
    s->slots[slot] = values;
    return absl::OkStatus();
  }
  store_slot(values, precision, is_signed,
             rounding_key(precision.seed, s->step, static_cast<uint64_t>(file_index), slot),
             param.scalar_type(), &s->slots[slot], &s->scales[slot]);
  return absl::OkStatus();
}

absl::StatusOr<ParamState> FunctionalOptimizer::entry_state(const checkpoint::StateEntry& entry,
                                                            const at::Tensor& param,
                                                            int64_t file_index,
                                                            const OptionsDict& merged,
                                                            bool copy) const {
  const std::string what = name() + ".load_state_dict";
  const auto names = slot_names();
  ParamState s;
  s.initialized = true;
  bool has_step = false;
  std::array<LoadedSlot, 4> found;
  const StatePrecision precision = precision_in(name(), merged);
  const bool counts_steps = step_kind() != StepKind::kNone || precision.dtype != StateDtype::kParam;
  for (const auto& kv : entry) {
    const std::string k = kv.key().toStringRef();
    const c10::IValue& v = kv.value();
    if (k == "step") {
      if (!counts_steps) {
        return invalid(absl::StrCat(what, ": parameter ", file_index, " has a 'step' entry, which ",
                                    name(), " does not keep; ", kLoadAdvice));
      }
      absl::StatusOr<int64_t> step = loaded_step(v);
      if (!step.ok()) return state_error(what, k, file_index, step.status());
      s.step = *step;
      has_step = true;
      continue;
    }
    const c10::IValue** part = nullptr;
    for (size_t n = 0; n < names.size() && names[n] != nullptr && names[n][0] != '\0'; ++n) {
      const std::string slot = names[n];
      if (k == slot) part = &found[n].value;
      if (k == slot + kCodesSuffix) part = &found[n].codes;
      if (k == slot + kAbsmaxSuffix) part = &found[n].absmax;
    }
    if (part == nullptr) {
      return invalid(absl::StrCat(
          what, ": parameter ", file_index, " has unknown state key '", k, "' (", name(), " keeps ",
          known_keys(names, step_kind() != StepKind::kNone), "); ", kLoadAdvice));
    }
    *part = &v;
  }
  if (step_kind() != StepKind::kNone && !has_step) {
    return invalid(absl::StrCat(what, ": parameter ", file_index, " has state but no 'step' (",
                                name(), " counts the steps of every parameter with state); ",
                                kLoadAdvice));
  }
  const at::ScalarType dtype = update_dtype(param, merged);  // float32 with param_remainders
  const at::Tensor like =
      dtype == param.scalar_type() ? param : at::empty_like(param, param.options().dtype(dtype));
  for (size_t n = 0; n < found.size(); ++n) {
    const LoadedSlot& f = found[n];
    if (f.value == nullptr && f.codes == nullptr && f.absmax == nullptr) continue;
    absl::Status ok =
        std::string(names[n]) == kParamRemainderKey
            ? load_param_remainder(f.value, param, name(), file_index, copy, &s.slots[n])
            : load_slot(f.value, f.codes, f.absmax, n, like, file_index, precision, copy, &s);
    if (!ok.ok()) return ok;
  }
  const std::array<bool, 4> fresh = required_slots(param, merged);
  for (size_t n = 0; n < fresh.size(); ++n) {
    if (fresh[n] && !s.slots[n].defined()) {
      return invalid(absl::StrCat(what, ": parameter ", file_index, " has state but no '", names[n],
                                  "' (", name(),
                                  " keeps it for every parameter with "
                                  "state under these options); ",
                                  kLoadAdvice));
    }
  }
  return s;
}

absl::StatusOr<FunctionalOptimizer::Loaded> FunctionalOptimizer::build_loaded(
    const c10::IValue& state_dict, const StateDictSource& source) const {
  const std::string what = name() + ".load_state_dict";
  absl::StatusOr<checkpoint::OptimizerStateDict> sd =
      checkpoint::parse_optimizer_state_dict(state_dict, what + ": the state dict");
  if (!sd.ok()) return invalid(absl::StrCat(sd.status().message(), "; ", kLoadAdvice));
  if (sd->param_groups.size() != 1) {
    return invalid(absl::StrCat(what,
                                ": functional optimizers have one parameter group, the "
                                "state dict has ",
                                sd->param_groups.size()));
  }
  const checkpoint::ParamGroup& group = sd->param_groups[0];
  if (group.params.size() != params_.size()) {
    return invalid(absl::StrCat(what, ": loaded state dict has a parameter group of ",
                                group.params.size(), " parameters, this optimizer has ",
                                params_.size(), "; ", kLoadAdvice));
  }
  if (absl::Status s = check_param_indices(*sd, params_.size(), what, source.file_group); !s.ok())
    return s;
  if (absl::Status s = check_option_numbers(group, source.file_group, what); !s.ok()) return s;
  Loaded loaded;
  OptionsDict merged = new_options_dict();
  absl::Status options_ok =
      loaded_options(group.options, source.file_group, &loaded.options, &loaded.kept, &merged);
  if (!options_ok.ok()) return options_ok;
  loaded.state.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    auto found = sd->state.find(group.params[i]);
    if (found == sd->state.end()) continue;
    absl::StatusOr<ParamState> s =
        entry_state(found->second, params_[i], file_index_of(source, group.params[i]), merged,
                    /*copy=*/true);
    if (!s.ok()) return s.status();
    loaded.state[i] = *std::move(s);
  }
  return loaded;
}

void FunctionalOptimizer::commit_loaded(Loaded loaded) {
  set_options(loaded.options);  // checked by build_loaded where the optimizer can (check_options)
  state_ = std::move(loaded.state);
  kept_group_keys_ = std::move(loaded.kept);
}

void FunctionalOptimizer::load_state_dict(const c10::IValue& state_dict) {
  load_state_dict(state_dict, StateDictSource{});
}

void FunctionalOptimizer::load_state_dict(const c10::IValue& state_dict,
                                          const StateDictSource& source) {
  absl::StatusOr<Loaded> loaded = build_loaded(state_dict, source);
  TORCH_CHECK(loaded.ok(), loaded.status().message());
  commit_loaded(*std::move(loaded));
}

absl::Status FunctionalOptimizer::check_state_dict(const c10::IValue& state_dict,
                                                   const StateDictSource& source) const {
  return build_loaded(state_dict, source).status();
}

absl::Status FunctionalOptimizer::check_state_entry(const checkpoint::StateEntry& entry,
                                                    const at::Tensor& param, int64_t file_index,
                                                    const OptionsDict& group_options,
                                                    size_t file_group) const {
  OptionsDict options = new_options_dict();
  OptionsDict merged = new_options_dict();
  std::vector<std::pair<std::string, c10::IValue>> kept;
  absl::Status ok = loaded_options(group_options, file_group, &options, &kept, &merged);
  if (!ok.ok()) return ok;
  return entry_state(entry, param, file_index, merged, /*copy=*/false).status();
}

}  // namespace dtrain::optim
