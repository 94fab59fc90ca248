#include "optim/functional/radam.h"

#include <cmath>

#include "optim/functional/internal/optimizer_impl.h"

namespace dtrain::optim::internal {

template <>
struct Descriptor<RAdamOptions> : DescriptorDefaults {
  static OptionTable<RAdamOptions> options() {
    // PyTorch's param_group order (decoupled_weight_decay after capturable) and check order.
    return OptionTable<RAdamOptions>("RAdam", RAdamOptions())
        .lr()
        .betas()
        .eps()
        .weight_decay()
        .maximize()
        .foreach ()
        .fixed("capturable", false)
        .option(DTRAIN_OPTION(decoupled_weight_decay))
        .differentiable()
        .check_order({"lr", "eps", "betas", "weight_decay"});
  }
  static constexpr StepKind kStep = StepKind::kFloatTensor;
  static constexpr std::array<const char*, 4> kSlots = {"exp_avg", "exp_avg_sq", "", ""};

  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&,
                      const RAdamOptions& o) {
    return count_step(s, p, {true, true, false, false});
  }
  // c[0]: bias_correction1; c[1]: bias_correction2 ** 0.5; c[2]: the rectification term, c[3]: 1
  // when it applies (rho_t > 5), else 0 (the update is then the bias-corrected momentum).
  static void scalars(std::array<double, 4>& c, const ParamState& s, const RAdamOptions& o) {
    const double step = static_cast<double>(s.step);
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    const double bias_correction2 = 1 - std::pow(beta2, step);
    const double rho_inf = 2 / (1 - beta2) - 1;
    const double rho_t = rho_inf - 2 * step * std::pow(beta2, step) / bias_correction2;
    c[0] = 1 - std::pow(beta1, step);
    c[1] = std::pow(bias_correction2, 0.5);
    const bool rectify = rho_t > 5.0;
    c[2] = rectify ? std::pow((rho_t - 4) * (rho_t - 2) * rho_inf /
                                  ((rho_inf - 4) * (rho_inf - 2) * rho_t),
                              0.5)
                   : 0;
    c[3] = rectify ? 1 : 0;
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const RAdamOptions& o, bool) {
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    at::Tensor grad = o.maximize() ? g.neg() : g;
    if (o.weight_decay() != 0) {
      if (o.decoupled_weight_decay()) {
        p.mul_(1 - o.lr() * o.weight_decay());
      } else {
        grad = grad.add(p, o.weight_decay());
      }
    }
    at::Tensor& exp_avg = s.slots[0];
    at::Tensor& exp_avg_sq = s.slots[1];
    exp_avg.lerp_(grad, 1 - beta1);
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    std::array<double, 4> c{};
    scalars(c, s, o);
    at::Tensor update = exp_avg.div(c[0]).mul(o.lr());
    if (c[3] != 0) {
      // (bias_correction2 ** 0.5) / exp_avg_sq_sqrt is Tensor.__rtruediv__: reciprocal() * scalar.
      const at::Tensor adaptive_lr = exp_avg_sq.sqrt().add_(o.eps()).reciprocal().mul(c[1]);
      update = update.mul(adaptive_lr).mul(c[2]);
    }
    p.add_(update, -1.0);
  }
  template <typename T, bool kDecoupled, bool kRectify>
  static void loop(const FusedTensor<T>& t, int64_t lo, int64_t hi, const RAdamOptions& o) {
    T* __restrict p = t.p;
    const T* __restrict g = t.g;
    T* __restrict m = t.s[0];
    T* __restrict v = t.s[1];
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    const T w = static_cast<T>(1 - beta1);
    const T b2 = static_cast<T>(beta2), one_minus_b2 = static_cast<T>(1 - beta2);
    const T wd = static_cast<T>(o.weight_decay());
    const T decay = static_cast<T>(1 - o.lr() * o.weight_decay());
    const T eps = static_cast<T>(o.eps()), lr = static_cast<T>(o.lr());
    const T bc1 = static_cast<T>(t.c[0]), bc2_sqrt = static_cast<T>(t.c[1]),
            rect = static_cast<T>(t.c[2]);
    const T sign = o.maximize() ? T(-1) : T(1);
    for (int64_t k = lo; k < hi; ++k) {
      T pk = p[k];
      T gk = sign * g[k];
      if (kDecoupled) {
        pk = pk * decay;
      } else {
        gk = gk + wd * pk;
      }
      const T mk = lerp(m[k], gk, w);
      const T vk = v[k] * b2 + one_minus_b2 * gk * gk;
      m[k] = mk;
      v[k] = vk;
      T update = mk / bc1 * lr;
      if (kRectify) update = update * (T(1) / (std::sqrt(vk) + eps) * bc2_sqrt) * rect;
      p[k] = pk - update;
    }
  }
  template <typename T>
  static void kernel(const FusedTensor<T>& t, int64_t lo, int64_t hi, const RAdamOptions& o) {
    const bool rectify = t.c[3] != 0;
    if (o.decoupled_weight_decay()) {
      return rectify ? loop<T, true, true>(t, lo, hi, o) : loop<T, true, false>(t, lo, hi, o);
    }
    return rectify ? loop<T, false, true>(t, lo, hi, o) : loop<T, false, false>(t, lo, hi, o);
  }
};

}  // namespace dtrain::optim::internal

namespace dtrain::optim {
template class TypedFunctionalOptimizer<RAdamOptions>;
}  // namespace dtrain::optim
