#include "optim/functional/rmsprop.h"

#include "optim/functional/internal/optimizer_impl.h"

namespace dtrain::optim::internal {

template <>
struct Descriptor<RMSpropOptions> : DescriptorDefaults {
  static OptionTable<RMSpropOptions> options() {
    return OptionTable<RMSpropOptions>("RMSprop", RMSpropOptions())
        .lr()
        .option(DTRAIN_OPTION(momentum), non_negative("Invalid momentum value"))
        .option(DTRAIN_OPTION(alpha), non_negative("Invalid alpha value"))
        .eps()
        .option(DTRAIN_OPTION(centered))
        .weight_decay()
        .fixed("capturable", false)
        .foreach ()
        .maximize()
        .differentiable()
        .check_order({"lr", "eps", "momentum", "weight_decay", "alpha"});
  }
  static constexpr StepKind kStep = StepKind::kFloatTensor;
  static constexpr std::array<const char*, 4> kSlots = {"square_avg", "momentum_buffer", "grad_avg",
                                                        ""};

  static void require_state(const std::string& name, const ParamState& s, const at::Tensor&,
                            size_t index, const RMSpropOptions& o) {
    if (o.momentum() > 0) require_slot(s, 1, index, name, "momentum > 0", "momentum_buffer");
    if (o.centered()) require_slot(s, 2, index, name, "centered=True", "grad_avg");
  }
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&,
                      const RMSpropOptions& o) {
    return count_step(s, p, {true, o.momentum() > 0, o.centered(), false});
  }
  static void scalars(std::array<double, 4>&, const ParamState&, const RMSpropOptions&) {}
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const RMSpropOptions& o,
                   bool) {
    at::Tensor grad = o.maximize() ? g.neg() : g;
    if (o.weight_decay() != 0) grad = grad.add(p, o.weight_decay());
    at::Tensor& square_avg = s.slots[0];
    square_avg.mul_(o.alpha()).addcmul_(grad, grad, 1 - o.alpha());
    at::Tensor avg;
    if (o.centered()) {
      at::Tensor& grad_avg = s.slots[2];
      grad_avg.mul_(o.alpha()).add_(grad, 1 - o.alpha());
      avg = square_avg.addcmul(grad_avg, grad_avg, -1).sqrt_();
    } else {
      avg = square_avg.sqrt();
    }
    avg = avg.add_(o.eps());
    if (o.momentum() > 0) {
      at::Tensor& buf = s.slots[1];
      buf.mul_(o.momentum()).addcdiv_(grad, avg);
      p.add_(buf, -o.lr());
    } else {
      p.addcdiv_(grad, avg, -o.lr());
    }
  }
  template <typename T, bool kCentered, bool kMomentum>
  static void loop(const FusedTensor<T>& t, int64_t lo, int64_t hi, const RMSpropOptions& o) {
    T* __restrict p = t.p;
    const T* __restrict g = t.g;
    T* __restrict sq = t.s[0];
    T* __restrict buf = t.s[1];
    T* __restrict ga = t.s[2];
    const T alpha = static_cast<T>(o.alpha()), one_minus_alpha = static_cast<T>(1 - o.alpha());
    const T wd = static_cast<T>(o.weight_decay()), eps = static_cast<T>(o.eps());
    const T mom = static_cast<T>(o.momentum()), neg_lr = static_cast<T>(-o.lr());
    const T sign = o.maximize() ? T(-1) : T(1);
    for (int64_t k = lo; k < hi; ++k) {
      const T gk = sign * g[k] + wd * p[k];
      const T sqk = sq[k] * alpha + one_minus_alpha * gk * gk;
      sq[k] = sqk;
      T avg;
      if (kCentered) {
        const T gak = ga[k] * alpha + one_minus_alpha * gk;
        ga[k] = gak;
        avg = std::sqrt(sqk + T(-1) * gak * gak) + eps;
      } else {
        avg = std::sqrt(sqk) + eps;
      }
      if (kMomentum) {
        const T bk = buf[k] * mom + T(1) * gk / avg;
        buf[k] = bk;
        p[k] = p[k] + neg_lr * bk;
      } else {
        p[k] = p[k] + neg_lr * gk / avg;
      }
    }
  }
  template <typename T>
  static void kernel(const FusedTensor<T>& t, int64_t lo, int64_t hi, const RMSpropOptions& o) {
    const bool centered = o.centered(), momentum = o.momentum() > 0;
    if (centered && momentum) return loop<T, true, true>(t, lo, hi, o);
    if (centered) return loop<T, true, false>(t, lo, hi, o);
    if (momentum) return loop<T, false, true>(t, lo, hi, o);
    return loop<T, false, false>(t, lo, hi, o);
  }
};

}  // namespace dtrain::optim::internal

namespace dtrain::optim {
template class TypedFunctionalOptimizer<RMSpropOptions>;
}  // namespace dtrain::optim
