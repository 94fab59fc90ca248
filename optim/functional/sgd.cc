#include "optim/functional/sgd.h"

#include "optim/functional/internal/optimizer_impl.h"
#include "optim/functional/libtorch_compat.h"

namespace dtrain::optim::internal {

template <>
struct Descriptor<SGDOptions> : DescriptorDefaults {
  static OptionTable<SGDOptions> options() {
    return OptionTable<SGDOptions>("SGD", SGDOptions(0))
        .required("lr")
        .lr()
        .option(DTRAIN_OPTION(momentum), non_negative("Invalid momentum value"))
        .option(DTRAIN_OPTION(dampening))
        .weight_decay()
        .option(DTRAIN_OPTION(nesterov))
        .maximize()
        .foreach ()
        .differentiable()
        .fused()
        .check([](const SGDOptions& o) {
          TORCH_CHECK(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0),
                      "Nesterov momentum requires a momentum and zero dampening");
        });
  }
  static constexpr StepKind kStep = StepKind::kNone;
  static constexpr std::array<const char*, 4> kSlots = {"momentum_buffer", "", "", ""};
  // PyTorch 2.x keeps no momentum_buffer entry for parameters without a buffer (1.13 kept None).
  static constexpr bool kNoneForUndefinedSlots = false;

  // Returns true when the momentum buffer is new: the first update copies d_p into it. Momentum
  // switched on later starts a buffer the same way, as in PyTorch (its buffer is None until then).
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&, const SGDOptions& o) {
    s.initialized = true;
    if (o.momentum() != 0 && !s.slots[0].defined()) {
      s.slots[0] = at::empty_like(p, at::MemoryFormat::Preserve);
      return true;
    }
    return false;
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& grad, const SGDOptions& o,
                   bool fresh) {
    at::Tensor d_p = o.maximize() ? grad.neg() : grad;
    if (o.weight_decay() != 0) d_p = d_p.add(p, o.weight_decay());
    if (o.momentum() != 0) {
      at::Tensor& buf = s.slots[0];
      if (fresh) {
        buf.copy_(d_p);
      } else {
        buf.mul_(o.momentum()).add_(d_p, 1 - o.dampening());
      }
      d_p = o.nesterov() ? d_p.add(buf, o.momentum()) : buf;
    }
    p.add_(d_p, -o.lr());
  }
  static void scalars(std::array<double, 4>&, const ParamState&, const SGDOptions&) {}
  // Loop-invariant choices are template parameters so every variant is a branch-free loop the
  // compiler vectorises.
  template <typename T, bool kMomentum, bool kFirst, bool kNesterov>
  static void loop(const FusedTensor<T>& t, int64_t lo, int64_t hi, const SGDOptions& o) {
    T* __restrict p = t.p;
    const T* __restrict g = t.g;
    T* __restrict buf = t.s[0];
    const T wd = static_cast<T>(o.weight_decay());
    const T mom = static_cast<T>(o.momentum());
    const T damp = static_cast<T>(1 - o.dampening());
    const T neg_lr = static_cast<T>(-o.lr());
    const T sign = o.maximize() ? T(-1) : T(1);
    for (int64_t k = lo; k < hi; ++k) {
      T d = sign * g[k] + wd * p[k];
      if (kMomentum) {
        const T b = kFirst ? d : buf[k] * mom + damp * d;
        buf[k] = b;
        d = kNesterov ? d + mom * b : b;
      }
      p[k] = p[k] + neg_lr * d;
    }
  }
  template <typename T>
  static void kernel(const FusedTensor<T>& t, int64_t lo, int64_t hi, const SGDOptions& o) {
    // Momentum 0 ignores (and keeps) a buffer left from earlier steps, as the ATen path does.
    if (o.momentum() == 0) return loop<T, false, false, false>(t, lo, hi, o);
    if (t.first) {
      return o.nesterov() ? loop<T, true, true, true>(t, lo, hi, o)
                          : loop<T, true, true, false>(t, lo, hi, o);
    }
    return o.nesterov() ? loop<T, true, false, true>(t, lo, hi, o)
                        : loop<T, true, false, false>(t, lo, hi, o);
  }

  // CUDA: PyTorch's _fused_sgd, one at::_fused_sgd_ per (device, dtype) batch, split by whether
  // the momentum buffers are new (its is_first_step holds for a whole call, dtrain's `first` per
  // parameter: a parameter whose first gradient comes later starts its buffer the same way).
  static constexpr bool kCudaFused = true;
  static constexpr bool kCudaBatchByFirst = true;
  static bool cuda_wanted(const SGDOptions& o) { return o.fused().value_or(true); }
  // fused=True on CPU: ATen's CPU fused kernel, as PyTorch's (its numerics, its speed).
  static constexpr bool kCpuAtenFused = true;
  static std::array<bool, 4> cuda_slots(const SGDOptions& o) {
    return {o.momentum() != 0, false, false, false};
  }
  static void cuda_step(AtenFusedBatch& b, const SGDOptions& o) {
    // Momentum 0 passes no buffers (ATen requires that), ignoring one left from earlier steps.
    fused_sgd_(b.params, b.grads, b.slots[0], o.weight_decay(), o.momentum(), o.lr(), o.dampening(),
               o.nesterov(), o.maximize(), b.first);
    ++cuda_path_counts().fused;
  }
};

}  // namespace dtrain::optim::internal

namespace dtrain::optim {
template class TypedFunctionalOptimizer<SGDOptions>;
}  // namespace dtrain::optim
