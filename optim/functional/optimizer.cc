#include "optim/functional/optimizer.h"

#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "checkpoint/optimizer_state_dict.h"

namespace dtrain::optim {

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
  apply_options(merged_options(name(), options_dict(), options));
}

c10::IValue FunctionalOptimizer::state_dict() const {
  checkpoint::OptimizerStateDict sd;
  const auto names = slot_names();
  for (size_t i = 0; i < state_.size(); ++i) {
    const ParamState& s = state_[i];
    if (!s.initialized) continue;
    checkpoint::StateEntry entry = checkpoint::new_state_entry();
    if (step_kind() == StepKind::kInt) entry.insert("step", s.step);
    if (step_kind() == StepKind::kFloatTensor) {
      entry.insert("step", at::scalar_tensor(static_cast<double>(s.step), at::kFloat));
    }
    for (size_t k = 0; k < names.size() && names[k] != nullptr && names[k][0] != '\0'; ++k) {
      if (s.slots[k].defined()) {
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

void FunctionalOptimizer::load_state_dict(const c10::IValue& state_dict) {
  absl::StatusOr<checkpoint::OptimizerStateDict> sd = checkpoint::parse_optimizer_state_dict(
      state_dict, name() + ".load_state_dict: the state dict");
  TORCH_CHECK(sd.ok(), sd.status().message());
  TORCH_CHECK(sd->param_groups.size() == 1, name(),
              ".load_state_dict: functional optimizers have one parameter "
              "group, the state dict has ",
              sd->param_groups.size());
  const checkpoint::ParamGroup& group = sd->param_groups[0];
  TORCH_CHECK(group.params.size() == params_.size(), name(),
              ".load_state_dict: loaded state dict has a "
              "parameter group of ",
              group.params.size(), " parameters, this optimizer has ", params_.size());
  const std::vector<int64_t>& saved_index = group.params;

  // Build everything first, so a bad entry leaves the optimizer as it was.
  OptionsDict options = new_options_dict();
  std::vector<std::pair<std::string, c10::IValue>> kept;
  const OptionsDict known = options_dict();
  for (const auto& kv : group.options) {
    const std::string& key = kv.key().toStringRef();
    if (!known.contains(key)) kept.emplace_back(key, kv.value());
    if (known.contains(key) || is_torch_only_option(key)) options.insert(kv.key(), kv.value());
  }
  std::vector<ParamState> loaded(params_.size());
  const auto names = slot_names();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto found = sd->state.find(saved_index[i]);
    if (found == sd->state.end()) continue;
    const checkpoint::StateEntry& entry = found->second;
    ParamState& s = loaded[i];
    s.initialized = true;
    for (const auto& kv : entry) {
      const std::string k = kv.key().toStringRef();
      const c10::IValue& v = kv.value();
      if (k == "step") {
        TORCH_CHECK(step_kind() != StepKind::kNone, name(), ".load_state_dict: parameter ", i,
                    " has a 'step' entry, which ", name(), " does not keep");
        s.step = v.isTensor()   ? static_cast<int64_t>(v.toTensor().item<double>())
                 : v.isDouble() ? static_cast<int64_t>(v.toDouble())
                                : v.toInt();
        continue;
      }
      size_t slot = names.size();
      for (size_t n = 0; n < names.size() && names[n] != nullptr && names[n][0] != '\0'; ++n) {
        if (k == names[n]) slot = n;
      }
      TORCH_CHECK(slot < names.size(), name(), ".load_state_dict: parameter ", i,
                  " has unknown state key '", k, "'");
      if (v.isNone()) continue;
      TORCH_CHECK(v.isTensor(), name(), ".load_state_dict: state '", k, "' of parameter ", i,
                  " is not a tensor");
      const at::Tensor& t = v.toTensor();
      const std::vector<int64_t> shape = slot_shape(slot, params_[i]);
      if (params_[i].sizes().equals(shape)) {
        TORCH_CHECK(t.sizes() == params_[i].sizes(), name(), ".load_state_dict: state '", k,
                    "' of parameter ", i, " has shape ", t.sizes(), ", the parameter has shape ",
                    params_[i].sizes());
        s.slots[slot] = at::empty_like(params_[i]).copy_(t);
      } else {
        TORCH_CHECK(t.sizes().equals(shape), name(), ".load_state_dict: state '", k,
                    "' of parameter ", i, " has shape ", t.sizes(), ", ", name(),
                    " keeps it with shape ", c10::IntArrayRef(shape), " for a parameter of shape ",
                    params_[i].sizes(), "; load a state dict saved for these parameters");
        // PyTorch casts every state tensor but "step" to its parameter's dtype and device.
        s.slots[slot] = at::empty(shape, params_[i].options()).copy_(t);
      }
    }
  }
  set_options(options);
  state_ = std::move(loaded);
  kept_group_keys_ = std::move(kept);
}

}  // namespace dtrain::optim
