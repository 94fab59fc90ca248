// The built-in functional optimizers' machinery, shared by their functional_<name>.cc files:
// the per-optimizer Descriptor each of them specialises, the driver that runs it (lazy state,
// then the fused kernel over all contiguous float/double tensors in one parallel pass, the ATen
// path over the rest) and TypedFunctionalOptimizer's members. Internal to optim/.
//
// A descriptor (see functional_adamax.cc for a short one):
//   template <> struct Descriptor<AdamaxOptions> : DescriptorDefaults {
//     static OptionTable<AdamaxOptions> options();            // keys, checks, registry defaults
//     static constexpr auto kStep = StepKind::kFloatTensor;    // how "step" appears in state_dict
//     static constexpr std::array<const char*, 4> kSlots = {"exp_avg", "exp_inf", "", ""};
//     static bool prepare(ParamState&, const at::Tensor& p, const at::Tensor& g, const Options&);
//     static void scalars(std::array<double, 4>&, const ParamState&, const Options&);
//     static void aten(ParamState&, at::Tensor& p, const at::Tensor& g, const Options&, bool first);
//     template <typename T> static void kernel(const FusedTensor<T>&, int64_t lo, int64_t hi, const Options&);
//   };
//   template class TypedFunctionalOptimizer<AdamaxOptions>;    // the class, with its descriptor
#ifndef DTRAIN_OPTIM_INTERNAL_FUNCTIONAL_IMPL_H_
#define DTRAIN_OPTIM_INTERNAL_FUNCTIONAL_IMPL_H_

#include <array>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "optim/functional_optimizer_options.h"
#include "optim/internal/fused.h"

namespace dtrain::optim::internal {

using StepKind = FunctionalOptimizer::StepKind;

// Specialised by each built-in optimizer's .cc for its Options type.
template <typename Options>
struct Descriptor;

// What a descriptor may leave out.
struct DescriptorDefaults {
  // Slots without a tensor are written as None in state_dict() (PyTorch 1.13's SGD).
  static constexpr bool kNoneForUndefinedSlots = false;
  // State for every parameter at construction (PyTorch's Adagrad), by init(state, param, options).
  static constexpr bool kStateAtConstruction = false;
  // Checks, before any update, that a parameter's existing state has what the options need.
  template <typename Options>
  static void require_state(const std::string& optimizer, const ParamState&, size_t index, const Options&) {}
};

inline at::Tensor zeros_like_param(const at::Tensor& p) { return at::zeros_like(p, at::MemoryFormat::Preserve); }

// Lazy state, as PyTorch's: on a parameter's first update, step 0 and the slots marked in
// `zeroed` filled with zeros; then step += 1. Returns whether this was the first update.
inline bool count_step(ParamState& s, const at::Tensor& p, std::array<bool, 4> zeroed) {
  const bool fresh = !s.initialized;
  if (fresh) {
    s.initialized = true;
    s.step = 0;
    for (size_t k = 0; k < zeroed.size(); ++k) {
      if (zeroed[k]) s.slots[k] = zeros_like_param(p);
    }
  }
  s.step += 1;
  return fresh;
}

// PyTorch reads state[key] unconditionally once a parameter has state, so switching `option` on
// after the first step raises KeyError there; the same, as a message that says what to do.
inline void require_slot(const ParamState& s, size_t slot, size_t index, const std::string& optimizer,
                         const char* option, const char* key) {
  TORCH_CHECK(!s.initialized || s.slots[slot].defined(), optimizer, ": ", option, " needs the state '", key,
              "', which parameter ", index, " does not have: ", option, " was switched on after its first step "
              "(or the loaded state dict has no '", key, "'). PyTorch raises KeyError: '", key,
              "' here too; set ", option, " before the first step");
}

// The same kernel compiled for AVX2 (chosen at run time on CPUs that have it): every call inside is
// inlined into this function, so the loops are vectorised 8 floats wide instead of SSE2's 4. No FMA
// (a multiply-add stays two roundings), so results are bit-identical to the baseline kernel's.
template <typename Traits, typename T, typename Options>
__attribute__((target("avx2"), flatten)) void kernel_avx2(const FusedTensor<T>& t, int64_t lo, int64_t hi,
                                                          const Options& o) {
  Traits::template kernel<T>(t, lo, hi, o);
}

// Runs one optimizer's update over (index, gradient) pairs: Traits::require_state on each first
// (nothing changes when one fails), then Traits::prepare (lazy state, step count), then the fused
// kernel over all contiguous float/double tensors in one parallel pass, and Traits::aten (ATen
// operations, PyTorch's exact sequence) over the rest.
template <typename Traits, typename Options>
void drive(const std::string& name, std::vector<at::Tensor>& params, std::vector<ParamState>& state,
           const Options& o, const std::vector<std::pair<size_t, at::Tensor>>& work) {
  for (const auto& item : work) Traits::require_state(name, state[item.first], item.first, o);
  std::vector<FusedTensor<float>> f32;
  std::vector<FusedTensor<double>> f64;
  for (const auto& [i, g] : work) {
    ParamState& s = state[i];
    const bool first = Traits::prepare(s, params[i], g, o);
    if (fusable(params[i], g, s.slots)) {
      auto fill = [&](auto& list, auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        FusedTensor<T> t;
        t.p = params[i].template data_ptr<T>();
        t.g = g.template data_ptr<T>();
        for (size_t k = 0; k < 4; ++k) t.s[k] = s.slots[k].defined() ? s.slots[k].template data_ptr<T>() : nullptr;
        t.n = params[i].numel();
        t.first = first;
        Traits::scalars(t.c, s, o);
        list.push_back(t);
      };
      if (params[i].scalar_type() == at::kFloat) {
        fill(f32, static_cast<float*>(nullptr));
      } else {
        fill(f64, static_cast<double*>(nullptr));
      }
    } else {
      Traits::aten(s, params[i], g, o, first);
    }
  }
  const bool avx2 = cpu_has_avx2();
  for_each_range(f32, [&](const FusedTensor<float>& t, int64_t lo, int64_t hi) {
    avx2 ? kernel_avx2<Traits>(t, lo, hi, o) : Traits::template kernel<float>(t, lo, hi, o);
  });
  for_each_range(f64, [&](const FusedTensor<double>& t, int64_t lo, int64_t hi) {
    avx2 ? kernel_avx2<Traits>(t, lo, hi, o) : Traits::template kernel<double>(t, lo, hi, o);
  });
}

}  // namespace dtrain::optim::internal

namespace dtrain::optim {

template <typename Options>
TypedFunctionalOptimizer<Options>::TypedFunctionalOptimizer(std::vector<at::Tensor> params, Options options,
                                                            bool allow_empty_param_list)
    : FunctionalOptimizer(std::move(params)), options_(std::move(options)) {
  option_table().validate(options_);
  TORCH_CHECK(!params_.empty() || allow_empty_param_list, name(), ": optimizer got an empty parameter list "
              "(pass allow_empty_param_list = true, PyTorch's _allow_empty_param_list=True, where an empty "
              "list is expected, e.g. a ZeroRedundancyOptimizer rank that owns no parameter)");
  using D = internal::Descriptor<Options>;
  if constexpr (D::kStateAtConstruction) {
    for (size_t i = 0; i < params_.size(); ++i) D::init(state_[i], params_[i], options_);
  }
}

template <typename Options>
const OptionTable<Options>& TypedFunctionalOptimizer<Options>::option_table() {
  static const OptionTable<Options>* table = new OptionTable<Options>(internal::Descriptor<Options>::options());
  return *table;
}

template <typename Options>
void TypedFunctionalOptimizer<Options>::update(size_t index, const at::Tensor& grad) {
  internal::drive<internal::Descriptor<Options>>(name(), params_, state_, options_, {{index, grad}});
}

template <typename Options>
void TypedFunctionalOptimizer<Options>::update_all(const std::vector<at::Tensor>& grads) {
  std::vector<std::pair<size_t, at::Tensor>> work;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined()) work.emplace_back(i, grads[i]);
  }
  internal::drive<internal::Descriptor<Options>>(name(), params_, state_, options_, work);
}

template <typename Options>
FunctionalOptimizer::StepKind TypedFunctionalOptimizer<Options>::step_kind() const {
  return internal::Descriptor<Options>::kStep;
}

template <typename Options>
std::array<const char*, 4> TypedFunctionalOptimizer<Options>::slot_names() const {
  return internal::Descriptor<Options>::kSlots;
}

template <typename Options>
bool TypedFunctionalOptimizer<Options>::none_for_undefined_slots() const {
  return internal::Descriptor<Options>::kNoneForUndefinedSlots;
}

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_INTERNAL_FUNCTIONAL_IMPL_H_
