#include "optim/functional/adagrad.h"

#include "optim/functional/internal/optimizer_impl.h"
#include "optim/functional/libtorch_compat.h"

namespace dtrain::optim::internal {

template <>
struct Descriptor<AdagradOptions> : DescriptorDefaults {
  static OptionTable<AdagradOptions> options() {
    return OptionTable<AdagradOptions>("Adagrad", AdagradOptions())
        .lr()
        .option(DTRAIN_OPTION(lr_decay), non_negative("Invalid lr_decay value"))
        .eps()
        .weight_decay()
        .option(DTRAIN_OPTION(initial_accumulator_value),
                non_negative("Invalid initial_accumulator_value value"))
        .foreach ()
        .maximize()
        .differentiable()
        .fused()
        .check_order({"lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"});
  }
  static constexpr StepKind kStep = StepKind::kFloatTensor;
  static constexpr std::array<const char*, 4> kSlots = {"sum", "", "", ""};
  static constexpr bool kStateAtConstruction = true;

  static void init(ParamState& s, const at::Tensor& p, const AdagradOptions& o) {
    s.initialized = true;
    s.step = 0;
    s.slots[0] = at::full_like(p, o.initial_accumulator_value(), at::MemoryFormat::Preserve);
  }
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&,
                      const AdagradOptions& o) {
    const bool fresh = !s.initialized;
    if (fresh) init(s, p, o);
    s.step += 1;
    return fresh;
  }
  static void scalars(std::array<double, 4>& c, const ParamState& s, const AdagradOptions& o) {
    c[0] = o.lr() / (1 + (static_cast<double>(s.step) - 1) * o.lr_decay());  // clr
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const AdagradOptions& o,
                   bool) {
    at::Tensor grad = o.maximize() ? g.neg() : g;
    if (o.weight_decay() != 0) grad = grad.add(p, o.weight_decay());
    std::array<double, 4> c{};
    scalars(c, s, o);
    s.slots[0].addcmul_(grad, grad, 1);
    at::Tensor std = s.slots[0].sqrt().add_(o.eps());
    p.addcdiv_(grad, std, -c[0]);
  }
  template <typename T>
  static void kernel(const FusedTensor<T>& t, int64_t lo, int64_t hi, const AdagradOptions& o) {
    T* __restrict p = t.p;
    const T* __restrict g = t.g;
    T* __restrict sum = t.s[0];
    const T wd = static_cast<T>(o.weight_decay()), eps = static_cast<T>(o.eps());
    const T neg_clr = static_cast<T>(-t.c[0]);
    const T sign = o.maximize() ? T(-1) : T(1);
    for (int64_t k = lo; k < hi; ++k) {
      const T gk = sign * g[k] + wd * p[k];
      const T sk = sum[k] + T(1) * gk * gk;
      sum[k] = sk;
      p[k] = p[k] + neg_clr * gk / (std::sqrt(sk) + eps);
    }
  }

  // CUDA: by default PyTorch's CUDA default, _multi_tensor_adagrad's _foreach_ sequence with the
  // clr of each parameter's host step (torch.optim.Adagrad refuses fused=True on CUDA; ATen's
  // _fused_adagrad_ differs from it by up to 3.6e-7 after 10 steps, measured on an H200). With
  // fused=True, at::_fused_adagrad_ per (device, dtype) batch where this LibTorch has its kernel.
  static constexpr bool kCudaFused = true;
  static bool cuda_wanted(const AdagradOptions& o) { return o.fused().value_or(true); }
  static std::array<bool, 4> cuda_slots(const AdagradOptions&) {
    return {true, false, false, false};
  }
  static void cuda_step(AtenFusedBatch& b, const AdagradOptions& o) {
    static const bool has_fused = has_cuda_kernel("aten::_fused_adagrad_");
    if (has_fused && o.fused().value_or(false)) {
      fused_adagrad_(b.params, b.grads, b.slots[0], b.steps, o.lr(), o.lr_decay(), o.weight_decay(),
                     o.eps(), o.maximize());
      ++cuda_path_counts().fused;
      return;
    }
    std::vector<at::Tensor> grads = o.maximize() ? at::_foreach_neg(b.grads) : b.grads;
    if (o.weight_decay() != 0) grads = at::_foreach_add(grads, b.params, o.weight_decay());
    std::vector<c10::Scalar> minus_clr;
    for (int64_t step : b.step_counts) {
      minus_clr.emplace_back(-o.lr() / (1 + (static_cast<double>(step) - 1) * o.lr_decay()));
    }
    at::_foreach_addcmul_(b.slots[0], grads, grads);
    std::vector<at::Tensor> denom = at::_foreach_sqrt(b.slots[0]);
    at::_foreach_add_(denom, o.eps());
    at::_foreach_addcdiv_(b.params, at::_foreach_mul(grads, c10::ArrayRef<c10::Scalar>(minus_clr)),
                          denom);
    ++cuda_path_counts().foreach;
  }
};

}  // namespace dtrain::optim::internal

namespace dtrain::optim {
template class TypedFunctionalOptimizer<AdagradOptions>;
}  // namespace dtrain::optim
