#include "optim/functional/adamax.h"

#include <cmath>

#include "optim/functional/internal/optimizer_impl.h"

namespace dtrain::optim::internal {

template <>
struct Descriptor<AdamaxOptions> : DescriptorDefaults {
  static OptionTable<AdamaxOptions> options() {
    // The registry's lr is _FunctionalAdamax's 1e-3, not torch.optim.Adamax's 2e-3 (see the header).
    return OptionTable<AdamaxOptions>("Adamax", AdamaxOptions().lr(1e-3))
        .lr()
        .betas()
        .eps()
        .weight_decay()
        .foreach ()
        .maximize()
        .differentiable()
        .fixed("capturable", false)
        .check_order({"lr", "eps", "betas", "weight_decay"});
  }
  static constexpr StepKind kStep = StepKind::kFloatTensor;
  static constexpr std::array<const char*, 4> kSlots = {"exp_avg", "exp_inf", "", ""};

  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&, const AdamaxOptions&) {
    return count_step(s, p, {true, true, false, false});
  }
  static void scalars(std::array<double, 4>& c, const ParamState& s, const AdamaxOptions& o) {
    c[0] = o.lr() / (1 - std::pow(std::get<0>(o.betas()), static_cast<double>(s.step)));  // clr
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const AdamaxOptions& o,
                   bool) {
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    at::Tensor grad = o.maximize() ? g.neg() : g;
    if (o.weight_decay() != 0) grad = grad.add(p, o.weight_decay());
    at::Tensor& exp_avg = s.slots[0];
    at::Tensor& exp_inf = s.slots[1];
    exp_avg.mul_(beta1).add_(grad, 1 - beta1);
    at::Tensor norm_buf =
        at::cat({exp_inf.mul_(beta2).unsqueeze(0), grad.abs().add_(o.eps()).unsqueeze_(0)}, 0);
    at::amax_out(exp_inf, norm_buf, {0}, /*keepdim=*/false);
    std::array<double, 4> c{};
    scalars(c, s, o);
    p.addcdiv_(exp_avg, exp_inf, -c[0]);
  }
  template <typename T>
  static void kernel(const FusedTensor<T>& t, int64_t lo, int64_t hi, const AdamaxOptions& o) {
    T* __restrict p = t.p;
    const T* __restrict g = t.g;
    T* __restrict m = t.s[0];
    T* __restrict u = t.s[1];
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    const T b1 = static_cast<T>(beta1), one_minus_b1 = static_cast<T>(1 - beta1),
            b2 = static_cast<T>(beta2);
    const T wd = static_cast<T>(o.weight_decay()), eps = static_cast<T>(o.eps());
    const T neg_clr = static_cast<T>(-t.c[0]);
    const T sign = o.maximize() ? T(-1) : T(1);
    for (int64_t k = lo; k < hi; ++k) {
      const T gk = sign * g[k] + wd * p[k];
      const T mk = m[k] * b1 + one_minus_b1 * gk;
      const T a = u[k] * b2;
      const T b = std::abs(gk) + eps;
      const T uk = a > b ? a : b;
      m[k] = mk;
      u[k] = uk;
      p[k] = p[k] + neg_clr * mk / uk;
    }
  }
};

}  // namespace dtrain::optim::internal

namespace dtrain::optim {
template class TypedFunctionalOptimizer<AdamaxOptions>;
}  // namespace dtrain::optim
