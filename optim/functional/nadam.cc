#include "optim/functional/nadam.h"

#include <cmath>

#include "optim/functional/internal/optimizer_impl.h"

namespace dtrain::optim::internal {

template <>
struct Descriptor<NAdamOptions> : DescriptorDefaults {
  static OptionTable<NAdamOptions> options() {
    return OptionTable<NAdamOptions>("NAdam", NAdamOptions())
        .lr()
        .betas()
        .eps()
        .weight_decay()
        .option(DTRAIN_OPTION(momentum_decay), non_negative("Invalid momentum_decay value"))
        .option(DTRAIN_OPTION(decoupled_weight_decay))
        .maximize()
        .foreach ()
        .fixed("capturable", false)
        .differentiable()
        .check_order({"lr", "eps", "betas", "weight_decay", "momentum_decay"});
  }
  static constexpr StepKind kStep = StepKind::kFloatTensor;
  // PyTorch's key order: step, mu_product, exp_avg, exp_avg_sq.
  static constexpr std::array<const char*, 4> kSlots = {"mu_product", "exp_avg", "exp_avg_sq", ""};
  static constexpr std::array<bool, 4> kScalarSlots = {true, false, false, false};

  // The momentum cache mu_t = beta1 (1 - 0.5 * 0.96^(t * momentum_decay)).
  static double mu_at(const NAdamOptions& o, double step) {
    return std::get<0>(o.betas()) * (1.0 - 0.5 * std::pow(0.96, step * o.momentum_decay()));
  }
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&,
                      const NAdamOptions& o) {
    const bool fresh = count_step(s, p, {false, true, true, false});
    if (fresh) s.slots[0] = at::ones({}, at::kFloat);  // float32 on the CPU, as PyTorch's
    s.slots[0].mul_(
        mu_at(o, static_cast<double>(s.step)));  // mu_product *= mu, in the slot's dtype
    return fresh;
  }
  static void scalars(std::array<double, 4>& c, const ParamState& s, const NAdamOptions& o) {
    const double step = static_cast<double>(s.step);
    const double mu = mu_at(o, step), mu_next = mu_at(o, step + 1);
    const double mu_product = s.slots[0].item<double>();
    c[0] = 1 - std::pow(std::get<1>(o.betas()), step);          // bias_correction2
    c[1] = -o.lr() * (1.0 - mu) / (1.0 - mu_product);           // the gradient's coefficient
    c[2] = (-o.lr() * mu_next) / (1.0 - mu_product * mu_next);  // exp_avg's
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const NAdamOptions& o, bool) {
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    at::Tensor grad = o.maximize() ? g.neg() : g;
    if (o.weight_decay() != 0) {
      if (o.decoupled_weight_decay()) {
        p.mul_(1 - o.lr() * o.weight_decay());
      } else {
        grad = grad.add(p, o.weight_decay());
      }
    }
    at::Tensor& exp_avg = s.slots[1];
    at::Tensor& exp_avg_sq = s.slots[2];
    exp_avg.lerp_(grad, 1 - beta1);
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    std::array<double, 4> c{};
    scalars(c, s, o);
    at::Tensor denom = exp_avg_sq.div(c[0]).sqrt();
    denom.add_(o.eps());
    p.addcdiv_(grad, denom, c[1]);
    p.addcdiv_(exp_avg, denom, c[2]);
  }
  template <typename T, bool kDecoupled>
  static void loop(const FusedTensor<T>& t, int64_t lo, int64_t hi, const NAdamOptions& o) {
    T* __restrict p = t.p;
    const T* __restrict g = t.g;
    T* __restrict m = t.s[1];
    T* __restrict v = t.s[2];
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    const T w = static_cast<T>(1 - beta1);
    const T b2 = static_cast<T>(beta2), one_minus_b2 = static_cast<T>(1 - beta2);
    const T wd = static_cast<T>(o.weight_decay());
    const T decay = static_cast<T>(1 - o.lr() * o.weight_decay());
    const T eps = static_cast<T>(o.eps());
    const T bc2 = static_cast<T>(t.c[0]), c_grad = static_cast<T>(t.c[1]),
            c_avg = static_cast<T>(t.c[2]);
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
      const T denom = std::sqrt(vk / bc2) + eps;
      pk = pk + c_grad * gk / denom;
      p[k] = pk + c_avg * mk / denom;
    }
  }
  template <typename T>
  static void kernel(const FusedTensor<T>& t, int64_t lo, int64_t hi, const NAdamOptions& o) {
    return o.decoupled_weight_decay() ? loop<T, true>(t, lo, hi, o) : loop<T, false>(t, lo, hi, o);
  }
};

}  // namespace dtrain::optim::internal

namespace dtrain::optim {
template class TypedFunctionalOptimizer<NAdamOptions>;
}  // namespace dtrain::optim
