// The built-in functional optimizers' machinery, shared by their functional_<name>.cc files:
// the per-optimizer Descriptor each of them specialises, the driver that runs it (lazy state,
// then the fused kernel over all contiguous float/double tensors in one parallel pass, the ATen
// path over the rest) and TypedFunctionalOptimizer's members. Internal to optim/.
//
// A descriptor (see adamax.cc for a short one):
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
// and, where DescriptorDefaults' do not fit: require_state (state the options need), kFused = false
// (no kernel or scalars: the update is not elementwise -- Adafactor, SparseAdam, Muon), kScalarSlots
// (0-dim slots the kernel does not see: NAdam's mu_product), slot_shape_of (Adafactor's row_var),
// finish (state changed after the update: ASGD's eta and mu), check_params (Muon: 2-D only),
// kSparseGradients (SparseAdam), kStateAtConstruction with init (Adagrad), and kCudaFused with
// cuda_wanted, cuda_slots and cuda_step (Adam, AdamW, SGD, Adagrad: CUDA parameters through one of
// ATen's fused multi-tensor kernels per (device, dtype) batch, see drive_aten_fused).
#ifndef DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_OPTIMIZER_IMPL_H_
#define DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_OPTIMIZER_IMPL_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "optim/functional/internal/fused.h"
#include "optim/functional/internal/low_precision.h"
#include "optim/functional/internal/param_remainders.h"
#include "optim/functional/options.h"

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
  // Checks, before any update, that a parameter's existing state has what the options (and the
  // parameter, for Adafactor) need.
  template <typename Options>
  static void require_state(const std::string& optimizer, const ParamState&,
                            const at::Tensor& param, size_t index, const Options&) {}
  // Whether the update is elementwise and has a fused kernel; false: aten() for every parameter.
  static constexpr bool kFused = true;
  // Slots that are 0-dim scalars (created float32 on the CPU, as PyTorch's), not elementwise state:
  // left out of the kernel's pointers and of the fused path's layout checks.
  static constexpr std::array<bool, 4> kScalarSlots = {false, false, false, false};
  // A slot's shape (FunctionalOptimizer::slot_shape): the parameter's, or {} for a scalar slot.
  template <typename Self>
  static std::vector<int64_t> slot_shape_of(size_t slot, const at::Tensor& p) {
    return Self::kScalarSlots[slot] ? std::vector<int64_t>{} : p.sizes().vec();
  }
  // Runs after every parameter of the step was updated (state that changes after the update).
  template <typename Options>
  static void finish(ParamState&, const Options&) {}
  // Checks the parameter list at construction (Muon: 2-D only).
  static void check_params(const std::string& optimizer, const std::vector<at::Tensor>&) {}
  // Whether the update needs each parameter whole, in its shape (Adafactor's factored second
  // moment, Muon's orthogonalised matrices): then a ZeRO partition that cuts parameters into
  // element ranges would change the math, and ZeroRedundancyOptimizer refuses it.
  static constexpr bool kWholeParameters = false;
  // Gradients are sparse COO tensors (SparseAdam), not dense ones.
  static constexpr bool kSparseGradients = false;
  // Whether CUDA parameters go through ATen's fused multi-tensor kernels (drive_aten_fused). A
  // descriptor that says so has cuda_wanted(options) (its `fused` option: None or True),
  // cuda_slots(options) (the slots the kernel takes) and cuda_step(AtenFusedBatch&, options) (the
  // ATen call).
  static constexpr bool kCudaFused = false;
  // Batches split by prepare()'s `first` too (SGD: ATen's is_first_step holds for a whole call).
  static constexpr bool kCudaBatchByFirst = false;
  // Whether state_dtype="8bit" is offered (the Adam family), and which slots hold signed values
  // (the signed dynamic map) rather than non-negative ones (the unsigned map, finer near zero).
  static constexpr bool k8Bit = false;
  static constexpr std::array<bool, 4> kSignedSlots = {true, true, true, true};
  // Whether the descriptor has low_precision_kernel (internal/low_precision.h): a fused CPU
  // kernel that reads and writes bfloat16 or 8-bit slots in place; without one, low-precision
  // state goes through the float path one parameter at a time.
  static constexpr bool kLowPrecisionKernel = false;
};

// One batch of a CUDA step: the parameters of one (device, dtype) -- PyTorch's
// _group_tensors_by_device_and_dtype -- in parameter order, with what ATen's fused kernel takes.
struct AtenFusedBatch {
  c10::Device device = c10::Device(c10::kCPU);
  at::ScalarType dtype = at::kFloat;
  bool first = false;  // kCudaBatchByFirst: every parameter's state is new
  std::vector<at::Tensor> params, grads;
  std::array<std::vector<at::Tensor>, 4>
      slots;                            // the kernel's slots (cuda_slots), each parallel to params
  std::vector<at::Tensor> steps;        // each parameter's ParamState::device_step
  std::vector<int64_t> step_counts;     // each parameter's step, host side (foreach paths' scalars)
  std::vector<at::Tensor> stale_steps;  // device steps one behind: incremented before the call
};

// Makes s.device_step hold s.step, which prepare() has just counted: a step tensor one behind is
// queued in `stale` for the batch's increment (PyTorch's _foreach_add_(state_steps, 1)); any other
// (none yet, loaded state, an ATen-path step in between) is rebuilt from the host counter, without
// reading the device.
inline const at::Tensor& device_step(ParamState& s, const at::Tensor& p,
                                     std::vector<at::Tensor>& stale) {
  if (s.device_step.defined() && s.device_step.device() == p.device() &&
      s.device_step_value == s.step - 1) {
    stale.push_back(s.device_step);
  } else {
    s.device_step = at::scalar_tensor(static_cast<double>(s.step), p.options().dtype(at::kFloat));
  }
  s.device_step_value = s.step;
  return s.device_step;
}

inline at::Tensor zeros_like_param(const at::Tensor& p) {
  return at::zeros_like(p, at::MemoryFormat::Preserve);
}

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

// at::lerp's formula (its scalar path): start + w * (end - start) for |w| < 0.5, else
// end - (end - start) * (1 - w); PyTorch 2.x's exp_avg.lerp_(grad, 1 - beta1).
template <typename T>
inline T lerp(T start, T end, T w) {
  return (w < T(0.5) && w > T(-0.5)) ? start + w * (end - start) : end - (end - start) * (T(1) - w);
}

// PyTorch reads state[key] unconditionally once a parameter has state, so switching `option` on
// after the first step raises KeyError there; the same, as a message that says what to do.
inline void require_slot(const ParamState& s, size_t slot, size_t index,
                         const std::string& optimizer, const char* option, const char* key) {
  TORCH_CHECK(!s.initialized || s.slots[slot].defined(), optimizer, ": ", option,
              " needs the state '", key, "', which parameter ", index, " does not have: ", option,
              " was switched on after its first step "
              "(or the loaded state dict has no '",
              key, "'). PyTorch raises KeyError: '", key, "' here too; set ", option,
              " before the first step");
}

// The same kernel compiled for AVX2 (internal/fused.h's kernel_isa() picks it on CPUs that have
// it): every call inside is inlined, so the loops are vectorised 8 floats wide instead of SSE2's 4.
// No FMA (-ffp-contract=off: a multiply-add stays two roundings), so results are bit-identical to
// the baseline kernel's.
template <typename Traits, typename T, typename Options>
__attribute__((target("avx2"), flatten)) void kernel_avx2(const FusedTensor<T>& t, int64_t lo,
                                                          int64_t hi, const Options& o) {
  Traits::template kernel<T>(t, lo, hi, o);
}

// Traits' kernel in the build kernel_isa() names (AVX-512 CPUs run the AVX2 build: see KernelIsa).
template <typename Traits, typename T, typename Options>
void kernel_for(KernelIsa isa, const FusedTensor<T>& t, int64_t lo, int64_t hi, const Options& o) {
  if (isa >= KernelIsa::kAvx2) return kernel_avx2<Traits>(t, lo, hi, o);
  Traits::template kernel<T>(t, lo, hi, o);
}

// Whether fused=True on CPU runs ATen's CPU fused kernel through drive_aten_fused
// (Traits::kCpuAtenFused: Adam, AdamW, SGD) rather than dtrain's own fused CPU kernel.
template <typename Traits>
constexpr bool cpu_aten_fused() {
  if constexpr (requires { Traits::kCpuAtenFused; }) {
    return Traits::kCpuAtenFused;
  } else {
    return false;
  }
}

// The ATen-fused part of drive(): CUDA parameters (Traits::kCudaFused and the `fused` option not
// False) and CPU parameters with fused True where cpu_aten_fused: Traits::prepare
// on each, then per (device, dtype) batch, in order of first appearance, the stale device steps
// incremented and Traits::cuda_step -- one of ATen's fused multi-tensor kernels, as PyTorch's
// fused path calls it. A parameter the kernels cannot take (aten_fusable) runs Traits::aten.
template <typename Traits, typename Options>
void drive_aten_fused(std::vector<at::Tensor>& params, std::vector<ParamState>& state,
                      const Options& o, const std::vector<std::pair<size_t, at::Tensor>>& work) {
  std::vector<AtenFusedBatch> batches;
  const std::array<bool, 4> uses = Traits::cuda_slots(o);
  for (const auto& [i, g] : work) {
    ParamState& s = state[i];
    const at::Tensor& p = params[i];
    const bool first = Traits::prepare(s, params[i], g, o);
    std::array<at::Tensor, 4> slots;
    bool complete = true;
    for (size_t k = 0; k < 4; ++k) {
      if (uses[k]) {
        slots[k] = s.slots[k];
        complete = complete && slots[k].defined();
      }
    }
    if (!complete || !aten_fusable(p, g, slots)) {
      Traits::aten(s, params[i], g, o, first);
      continue;
    }
    const bool batch_first = Traits::kCudaBatchByFirst && first;
    auto it = std::find_if(batches.begin(), batches.end(), [&](const AtenFusedBatch& b) {
      return b.device == p.device() && b.dtype == p.scalar_type() && b.first == batch_first;
    });
    if (it == batches.end()) {
      AtenFusedBatch fresh;
      fresh.device = p.device();
      fresh.dtype = p.scalar_type();
      fresh.first = batch_first;
      batches.push_back(std::move(fresh));
      it = batches.end() - 1;
    }
    AtenFusedBatch& b = *it;
    b.params.push_back(p);
    b.grads.push_back(g);
    for (size_t k = 0; k < 4; ++k) {
      if (uses[k]) b.slots[k].push_back(slots[k]);
    }
    if constexpr (Traits::kStep != StepKind::kNone) {
      b.steps.push_back(device_step(s, p, b.stale_steps));
      b.step_counts.push_back(s.step);
    }
  }
  for (AtenFusedBatch& b : batches) {
    if (!b.stale_steps.empty()) at::_foreach_add_(b.stale_steps, 1);
    Traits::cuda_step(b, o);
  }
}

// The fused part of drive(): Traits::prepare on each, then the kernel over all contiguous
// float/double tensors in one parallel pass, Traits::aten over the rest; CUDA parameters of an
// optimizer with ATen fused kernels go to drive_aten_fused instead.
template <typename Traits, typename Options>
void drive_fused(std::vector<at::Tensor>& params, std::vector<ParamState>& state, const Options& o,
                 const std::vector<std::pair<size_t, at::Tensor>>& work) {
  std::vector<FusedTensor<float>> f32;
  std::vector<FusedTensor<double>> f64;
  std::vector<std::pair<size_t, at::Tensor>> cuda_work;
  for (const auto& [i, g] : work) {
    if constexpr (Traits::kCudaFused) {
      // ATen's fused kernels: CUDA unless fused is False; CPU when fused is True (PyTorch's
      // fused=True on CPU, the same kernel and numerics) for the optimizers that say so.
      const bool aten = params[i].is_cuda() ? Traits::cuda_wanted(o)
                                            : cpu_aten_fused<Traits>() && o.fused().value_or(false);
      if (aten) {
        cuda_work.emplace_back(i, g);
        continue;
      }
    }
    ParamState& s = state[i];
    const bool first = Traits::prepare(s, params[i], g, o);
    std::array<at::Tensor, 4> elementwise;  // the slots the kernel sees
    for (size_t k = 0; k < 4; ++k) {
      if (!Traits::kScalarSlots[k]) elementwise[k] = s.slots[k];
    }
    if (fusable(params[i], g, elementwise)) {
      auto fill = [&](auto& list, auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        FusedTensor<T> t;
        t.p = params[i].template data_ptr<T>();
        t.g = g.template data_ptr<T>();
        for (size_t k = 0; k < 4; ++k) {
          t.s[k] = elementwise[k].defined() ? elementwise[k].template data_ptr<T>() : nullptr;
        }
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
  const KernelIsa isa = kernel_isa();
  for_each_range(f32, [&](const FusedTensor<float>& t, int64_t lo, int64_t hi) {
    kernel_for<Traits>(isa, t, lo, hi, o);
  });
  for_each_range(f64, [&](const FusedTensor<double>& t, int64_t lo, int64_t hi) {
    kernel_for<Traits>(isa, t, lo, hi, o);
  });
  if constexpr (Traits::kCudaFused) {
    if (!cuda_work.empty()) drive_aten_fused<Traits>(params, state, o, cuda_work);
  }
}

// Runs one optimizer's update over (index, gradient) pairs: Traits::require_state on each first
// (nothing changes when one fails), then Traits::prepare (lazy state, step count) and the update:
// the fused kernel over all contiguous float/double CPU tensors in one parallel pass, ATen's fused
// multi-tensor kernels over CUDA tensors (Traits::kCudaFused: drive_aten_fused), Traits::aten (ATen
// operations, PyTorch's exact sequence) over the rest, or over all when !Traits::kFused; then
// Traits::finish on each. State kept in bfloat16 or 8 bits goes through drive_low_precision;
// Adam's and AdamW's param_remainders through drive_with_remainders (internal/param_remainders.h),
// which runs this over float32 masters.
template <typename Traits, typename Options>
void drive(const std::string& name, std::vector<at::Tensor>& params, std::vector<ParamState>& state,
           const Options& o, const std::vector<std::pair<size_t, at::Tensor>>& work) {
  if constexpr (requires { Traits::kRemainderSlot; }) {  // Adam's and AdamW's param_remainders
    if (o.param_remainders()) return drive_with_remainders<Traits>(name, params, state, o, work);
    for (const auto& item : work) state[item.first].slots[Traits::kRemainderSlot] = at::Tensor();
  }
  for (const auto& [i, g] : work) Traits::require_state(name, state[i], params[i], i, o);
  const StatePrecision precision = precision_of(name, o, Traits::k8Bit);
  if (precision.dtype != StateDtype::kParam) {
    drive_low_precision<Traits>(params, state, o, work, precision);
  } else if constexpr (Traits::kFused) {
    drive_fused<Traits>(params, state, o, work);
  } else {
    for (const auto& [i, g] : work) {
      const bool first = Traits::prepare(state[i], params[i], g, o);
      Traits::aten(state[i], params[i], g, o, first);
    }
  }
  for (const auto& item : work) Traits::finish(state[item.first], o);
}

}  // namespace dtrain::optim::internal

namespace dtrain::optim {

template <typename Options>
TypedFunctionalOptimizer<Options>::TypedFunctionalOptimizer(std::vector<at::Tensor> params,
                                                            Options options,
                                                            bool allow_empty_param_list)
    : FunctionalOptimizer(std::move(params)), options_(std::move(options)) {
  option_table().validate(options_);
  TORCH_CHECK(
      !params_.empty() || allow_empty_param_list, name(),
      ": optimizer got an empty parameter list "
      "(pass allow_empty_param_list = true, PyTorch's _allow_empty_param_list=True, where an empty "
      "list is expected, e.g. a ZeroRedundancyOptimizer rank that owns no parameter)");
  using D = internal::Descriptor<Options>;
  D::check_params(name(), params_);
  internal::check_remainder_params(name(), params_, options_);
  if constexpr (D::kStateAtConstruction) {
    for (size_t i = 0; i < params_.size(); ++i) D::init(state_[i], params_[i], options_);
  }
}

template <typename Options>
const OptionTable<Options>& TypedFunctionalOptimizer<Options>::option_table() {
  static const OptionTable<Options>* table =
      new OptionTable<Options>(internal::Descriptor<Options>::options().state_precision(
          internal::Descriptor<Options>::k8Bit));
  return *table;
}

template <typename Options>
bool TypedFunctionalOptimizer<Options>::needs_whole_parameters() {
  return internal::Descriptor<Options>::kWholeParameters;
}

template <typename Options>
void TypedFunctionalOptimizer<Options>::update(size_t index, const at::Tensor& grad) {
  internal::drive<internal::Descriptor<Options>>(name(), params_, state_, options_,
                                                 {{index, grad}});
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

template <typename Options>
std::array<bool, 4> TypedFunctionalOptimizer<Options>::signed_slots() const {
  return internal::Descriptor<Options>::kSignedSlots;
}

template <typename Options>
std::array<bool, 4> TypedFunctionalOptimizer<Options>::scalar_slots() const {
  return internal::Descriptor<Options>::kScalarSlots;
}

template <typename Options>
std::vector<int64_t> TypedFunctionalOptimizer<Options>::slot_shape(size_t slot,
                                                                   const at::Tensor& param) const {
  using D = internal::Descriptor<Options>;
  return D::template slot_shape_of<D>(slot, param);
}

template <typename Options>
at::ScalarType TypedFunctionalOptimizer<Options>::update_dtype(const at::Tensor& param,
                                                               const OptionsDict& merged) const {
  if constexpr (requires { options_.param_remainders(); }) {
    if (param.scalar_type() == at::kBFloat16 &&
        option_table().from_dict(merged, options_).param_remainders()) {
      return at::kFloat;  // the master weight's
    }
  }
  return param.scalar_type();
}

template <typename Options>
bool TypedFunctionalOptimizer<Options>::takes_sparse_gradients() const {
  return internal::Descriptor<Options>::kSparseGradients;
}

template <typename Options>
std::array<bool, 4> TypedFunctionalOptimizer<Options>::required_slots(
    const at::Tensor& param, const OptionsDict& merged) const {
  using D = internal::Descriptor<Options>;
  const Options o = option_table().from_dict(merged, options_);
  const at::Tensor meta = at::empty(param.sizes(), param.options().device(at::kMeta));
  ParamState fresh_state;  // a parameter's first update
  D::prepare(fresh_state, meta, meta, o);
  ParamState later;  // an update of a parameter that has state, but no slots
  later.initialized = true;
  later.step = 1;
  try {
    D::prepare(later, meta, meta, o);
  } catch (const c10::Error&) {
    // It needs its slots (NAdam's mu_product): every slot of a fresh state is required.
  }
  std::array<bool, 4> required{};
  for (size_t k = 0; k < required.size(); ++k) {
    required[k] = fresh_state.slots[k].defined() && !later.slots[k].defined();
  }
  return required;
}

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_INTERNAL_OPTIMIZER_IMPL_H_
