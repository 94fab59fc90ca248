#include "optim/functional/adadelta.h"

#include "optim/functional/internal/optimizer_impl.h"

namespace dtrain::optim::internal {

template <>
struct Descriptor<AdadeltaOptions> : DescriptorDefaults {
  static OptionTable<AdadeltaOptions> options() {
    return OptionTable<AdadeltaOptions>("Adadelta", AdadeltaOptions())
        .lr()
        .option(DTRAIN_OPTION(rho), in_unit_interval("Invalid rho value"))
        .eps()
        .weight_decay()
        .maximize()
        .fixed("capturable", false)
        .foreach ()
        .differentiable();
  }
  static constexpr StepKind kStep = StepKind::kFloatTensor;
  static constexpr std::array<const char*, 4> kSlots = {"square_avg", "acc_delta", "", ""};

  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&,
                      const AdadeltaOptions&) {
    return count_step(s, p, {true, true, false, false});
  }
  static void scalars(std::array<double, 4>&, const ParamState&, const AdadeltaOptions&) {}
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const AdadeltaOptions& o,
                   bool) {
    at::Tensor grad = o.maximize() ? g.neg() : g;
    if (o.weight_decay() != 0) grad = grad.add(p, o.weight_decay());
    at::Tensor& square_avg = s.slots[0];
    at::Tensor& acc_delta = s.slots[1];
    square_avg.mul_(o.rho()).addcmul_(grad, grad, 1 - o.rho());
    at::Tensor std = square_avg.add(o.eps()).sqrt_();
    at::Tensor delta = acc_delta.add(o.eps()).sqrt_().div_(std).mul_(grad);
    acc_delta.mul_(o.rho()).addcmul_(delta, delta, 1 - o.rho());
    p.add_(delta, -o.lr());
  }
  template <typename T>
  static void kernel(const FusedTensor<T>& t, int64_t lo, int64_t hi, const AdadeltaOptions& o) {
    T* __restrict p = t.p;
    const T* __restrict g = t.g;
    T* __restrict sq = t.s[0];
    T* __restrict acc = t.s[1];
    const T wd = static_cast<T>(o.weight_decay()), eps = static_cast<T>(o.eps());
    const T rho = static_cast<T>(o.rho()), one_minus_rho = static_cast<T>(1 - o.rho());
    const T neg_lr = static_cast<T>(-o.lr());
    const T sign = o.maximize() ? T(-1) : T(1);
    for (int64_t k = lo; k < hi; ++k) {
      const T gk = sign * g[k] + wd * p[k];
      const T sqk = sq[k] * rho + one_minus_rho * gk * gk;
      sq[k] = sqk;
      const T delta = std::sqrt(acc[k] + eps) / std::sqrt(sqk + eps) * gk;
      acc[k] = acc[k] * rho + one_minus_rho * delta * delta;
      p[k] = p[k] + neg_lr * delta;
    }
  }
};

}  // namespace dtrain::optim::internal

namespace dtrain::optim {
template class TypedFunctionalOptimizer<AdadeltaOptions>;
}  // namespace dtrain::optim
