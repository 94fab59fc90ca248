#include "optim/functional/adam.h"

#include <cmath>

#include "optim/functional/internal/adam_low_precision.h"
#include "optim/functional/internal/optimizer_impl.h"
#include "optim/functional/libtorch_compat.h"

namespace dtrain::optim::internal {

// Adam (kDecoupled = false: L2 weight decay on the gradient, or decoupled where its
// decoupled_weight_decay option is on) and AdamW (kDecoupled = true: always decoupled).
template <bool kDecoupled, typename Options>
struct AdamDescriptor : DescriptorDefaults {
  static bool decoupled(const Options& o) {
    if constexpr (kDecoupled) {
      return true;
    } else {
      return o.decoupled_weight_decay();
    }
  }
  // PyTorch checks eps before betas; its param_group lists betas first.
  static OptionTable<Options> options(const char* name) {
    return OptionTable<Options>(name, Options())
        .lr()
        .betas()
        .eps()
        .weight_decay()
        .option(DTRAIN_OPTION(amsgrad))
        .maximize()
        .foreach ()
        .check_order({"lr", "eps", "betas", "weight_decay"});
  }
  static constexpr StepKind kStep = StepKind::kFloatTensor;
  // Slot 3: param_remainders' int16 remainder (internal/param_remainders.h), which the update
  // itself never sees.
  static constexpr std::array<const char*, 4> kSlots = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                                        kParamRemainderKey};
  static constexpr size_t kRemainderSlot = 3;

  static void require_state(const std::string& name, const ParamState& s, const at::Tensor&,
                            size_t index, const Options& o) {
    if (o.amsgrad()) require_slot(s, 2, index, name, "amsgrad=True", "max_exp_avg_sq");
  }
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&, const Options& o) {
    return count_step(s, p, {true, true, o.amsgrad(), false});
  }
  static void scalars(std::array<double, 4>& c, const ParamState& s, const Options& o) {
    const double step = static_cast<double>(s.step);
    const double bc1 = 1 - std::pow(std::get<0>(o.betas()), step);
    const double bc2 = 1 - std::pow(std::get<1>(o.betas()), step);
    c[0] = o.lr() / bc1;    // step_size
    c[1] = std::sqrt(bc2);  // bias_correction2_sqrt
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const Options& o, bool) {
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    at::Tensor grad = o.maximize() ? g.neg() : g;
    if (decoupled(o)) {
      p.mul_(1 - o.lr() * o.weight_decay());
    } else if (o.weight_decay() != 0) {
      grad = grad.add(p, o.weight_decay());
    }
    at::Tensor& exp_avg = s.slots[0];
    at::Tensor& exp_avg_sq = s.slots[1];
    exp_avg.mul_(beta1).add_(grad, 1 - beta1);
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    std::array<double, 4> c{};
    scalars(c, s, o);
    at::Tensor denom;
    if (o.amsgrad()) {
      at::maximum_out(s.slots[2], s.slots[2], exp_avg_sq);
      denom = (s.slots[2].sqrt() / c[1]).add_(o.eps());
    } else {
      denom = (exp_avg_sq.sqrt() / c[1]).add_(o.eps());
    }
    p.addcdiv_(exp_avg, denom, -c[0]);
  }
  // The scalars of one tensor's update, in the kernel's type.
  template <typename T>
  struct Constants {
    Constants(const Options& o, const std::array<double, 4>& c)
        : b1(static_cast<T>(std::get<0>(o.betas()))),
          one_minus_b1(static_cast<T>(1 - std::get<0>(o.betas()))),
          b2(static_cast<T>(std::get<1>(o.betas()))),
          one_minus_b2(static_cast<T>(1 - std::get<1>(o.betas()))),
          wd(static_cast<T>(o.weight_decay())),
          decay(static_cast<T>(1 - o.lr() * o.weight_decay())),
          eps(static_cast<T>(o.eps())),
          neg_step_size(static_cast<T>(-c[0])),
          bc2_sqrt(static_cast<T>(c[1])),
          sign(o.maximize() ? T(-1) : T(1)) {}
    T b1, one_minus_b1, b2, one_minus_b2, wd, decay, eps, neg_step_size, bc2_sqrt, sign;
  };
  // One element: the new parameter; m, v (and vmax with amsgrad) updated in place. Every kernel
  // (float, double, bfloat16 and 8-bit state) runs exactly this arithmetic.
  template <typename T, bool kAmsgrad, bool kDecoupledDecay>
  static inline __attribute__((always_inline)) T element(const Constants<T>& c, T pk, T gk, T& mk,
                                                         T& vk, T& vmk) {
    gk = c.sign * gk;
    if (kDecoupledDecay) {
      pk = pk * c.decay;
    } else {
      gk = gk + c.wd * pk;
    }
    mk = mk * c.b1 + c.one_minus_b1 * gk;
    vk = vk * c.b2 + c.one_minus_b2 * gk * gk;
    T vm = vk;
    if (kAmsgrad) {
      vm = vk > vmk ? vk : vmk;
      vmk = vm;
    }
    const T denom = std::sqrt(vm) / c.bc2_sqrt + c.eps;
    return pk + c.neg_step_size * mk / denom;
  }
  template <typename T, bool kAmsgrad, bool kDecoupledDecay>
  static void loop(const FusedTensor<T>& t, int64_t lo, int64_t hi, const Options& o) {
    T* __restrict p = t.p;
    const T* __restrict g = t.g;
    T* __restrict m = t.s[0];
    T* __restrict v = t.s[1];
    T* __restrict vmax = t.s[2];
    const Constants<T> c(o, t.c);
    for (int64_t k = lo; k < hi; ++k) {
      T mk = m[k], vk = v[k], vmk = kAmsgrad ? vmax[k] : T(0);
      p[k] = element<T, kAmsgrad, kDecoupledDecay>(c, p[k], g[k], mk, vk, vmk);
      m[k] = mk;
      v[k] = vk;
      if (kAmsgrad) vmax[k] = vmk;
    }
  }
  template <typename T>
  static void kernel(const FusedTensor<T>& t, int64_t lo, int64_t hi, const Options& o) {
    // amsgrad off ignores (and keeps) a max_exp_avg_sq from earlier steps, as the ATen path does.
    if (decoupled(o)) {
      return o.amsgrad() ? loop<T, true, true>(t, lo, hi, o) : loop<T, false, true>(t, lo, hi, o);
    }
    return o.amsgrad() ? loop<T, true, false>(t, lo, hi, o) : loop<T, false, false>(t, lo, hi, o);
  }

  // State in bfloat16 or 8 bits (state_precision.h): exp_avg signed, the second moments not.
  static constexpr bool k8Bit = true;
  static constexpr std::array<bool, 4> kSignedSlots = {true, false, false, true};
  static constexpr bool kLowPrecisionKernel = true;
  static LowPrecisionTensor low_precision_tensor(ParamState& s, const at::Tensor& p,
                                                 const at::Tensor& g, const Options& o,
                                                 const StatePrecision& precision, size_t i) {
    prepare(s, p, g, o);
    LowPrecisionTensor t;
    if (p.scalar_type() == at::kBFloat16) {  // param_remainders (internal/param_remainders.h)
      t.pb = reinterpret_cast<uint16_t*>(p.data_ptr<at::BFloat16>());
      t.gb = reinterpret_cast<const uint16_t*>(g.data_ptr<at::BFloat16>());
    } else {
      t.p = p.data_ptr<float>();
      t.g = g.data_ptr<float>();
    }
    t.n = p.numel();
    bind_low_precision_slots(s, kSignedSlots, precision, i, t);
    scalars(t.c, s, o);
    return t;
  }
  static void low_precision_kernel(KernelIsa isa, const LowPrecisionTensor& t, int64_t lo,
                                   int64_t hi, const Options& o, const StatePrecision& precision) {
    adam_low_precision<AdamDescriptor>(isa, t, lo, hi, o, precision, decoupled(o));
  }

  // CUDA: PyTorch's _fused_adam, one at::_fused_adam(w)_ per (device, dtype) batch; the kernel
  // reads each parameter's float32 step on the device (drive_aten_fused has counted it).
  static constexpr bool kCudaFused = true;
  static bool cuda_wanted(const Options& o) { return o.fused().value_or(true); }
  // fused=True on CPU: ATen's CPU fused kernel, as PyTorch's (its numerics, its speed).
  static constexpr bool kCpuAtenFused = true;
  static std::array<bool, 4> cuda_slots(const Options& o) {
    return {true, true, o.amsgrad(), false};
  }
  static void cuda_step(AtenFusedBatch& b, const Options& o) {
    fused_adam_(decoupled(o), b.params, b.grads, b.slots[0], b.slots[1], b.slots[2], b.steps,
                o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                o.amsgrad(), o.maximize());
    ++cuda_path_counts().fused;
  }
};

template <>
struct Descriptor<AdamOptions> : AdamDescriptor<false, AdamOptions> {
  static OptionTable<AdamOptions> options() {
    auto table =
        AdamDescriptor::options("Adam").fixed("capturable", false).differentiable().fused();
    if constexpr (kAdamHasDecoupledWeightDecay) {
      table.option(DTRAIN_OPTION(decoupled_weight_decay));
    } else {
      table.check([](const AdamOptions& o) {
        TORCH_CHECK(!o.decoupled_weight_decay(),
                    "Adam: decoupled_weight_decay=True needs LibTorch 2.7 or newer "
                    "(PyTorch ",
                    TORCH_VERSION,
                    "'s Adam has no such option and its state dict could not "
                    "record it); use AdamW");
      });
    }
    return table.dtrain_flag(DTRAIN_OPTION(param_remainders));
  }
};

template <>
struct Descriptor<AdamWOptions> : AdamDescriptor<true, AdamWOptions> {
  static OptionTable<AdamWOptions> options() {
    // PyTorch 2.7+'s AdamW is Adam with decoupled_weight_decay=True, and its param_group says so.
    auto table =
        AdamDescriptor::options("AdamW").fixed("capturable", false).differentiable().fused();
    if constexpr (kAdamHasDecoupledWeightDecay) table.fixed("decoupled_weight_decay", true);
    return table.dtrain_flag(DTRAIN_OPTION(param_remainders));
  }
};

}  // namespace dtrain::optim::internal

namespace dtrain::optim {
template class TypedFunctionalOptimizer<AdamOptions>;
template class TypedFunctionalOptimizer<AdamWOptions>;
}  // namespace dtrain::optim
