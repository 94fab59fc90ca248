#include "optim/functional/rprop.h"

#include "optim/functional/internal/optimizer_impl.h"

namespace dtrain::optim::internal {

template <>
struct Descriptor<RpropOptions> : DescriptorDefaults {
  static OptionTable<RpropOptions> options() {
    return OptionTable<RpropOptions>("Rprop", RpropOptions())
        .lr()
        .option(DTRAIN_OPTION(etas),
                [](const DoublePair& etas) {
                  const auto [etaminus, etaplus] = etas;
                  TORCH_CHECK(0.0 < etaminus && etaminus < 1.0 && 1.0 < etaplus,
                              "Invalid eta values: ", python_float_repr(etaminus), ", ",
                              python_float_repr(etaplus));
                })
        .option(DTRAIN_OPTION(step_sizes))
        .foreach ()
        .maximize()
        .differentiable()
        .fixed("capturable", false);
  }
  static constexpr StepKind kStep = StepKind::kFloatTensor;
  static constexpr std::array<const char*, 4> kSlots = {"prev", "step_size", "", ""};

  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor& g,
                      const RpropOptions& o) {
    const bool fresh = count_step(s, p, {true, false, false, false});
    if (fresh) s.slots[1] = at::full_like(g, o.lr());
    return fresh;
  }
  static void scalars(std::array<double, 4>&, const ParamState&, const RpropOptions&) {}
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const RpropOptions& o, bool) {
    const auto [etaminus, etaplus] = o.etas();
    const auto [step_size_min, step_size_max] = o.step_sizes();
    at::Tensor grad = o.maximize() ? g.neg() : g;
    at::Tensor& prev = s.slots[0];
    at::Tensor& step_size = s.slots[1];
    at::Tensor sign = grad.mul(prev).sign();
    sign.masked_fill_(sign.gt(0), etaplus);
    sign.masked_fill_(sign.lt(0), etaminus);
    sign.masked_fill_(sign.eq(0), 1);
    step_size.mul_(sign).clamp_(step_size_min, step_size_max);
    grad = grad.clone(at::MemoryFormat::Preserve);
    grad.masked_fill_(sign.eq(etaminus), 0);
    p.addcmul_(grad.sign(), step_size, -1);
    prev.copy_(grad);
  }
  template <typename T>
  static void kernel(const FusedTensor<T>& t, int64_t lo, int64_t hi, const RpropOptions& o) {
    T* __restrict p = t.p;
    const T* __restrict g = t.g;
    T* __restrict prev = t.s[0];
    T* __restrict ss = t.s[1];
    const T etaminus = static_cast<T>(std::get<0>(o.etas())),
            etaplus = static_cast<T>(std::get<1>(o.etas()));
    const T lo_s = static_cast<T>(std::get<0>(o.step_sizes())),
            hi_s = static_cast<T>(std::get<1>(o.step_sizes()));
    const T sgn = o.maximize() ? T(-1) : T(1);
    for (int64_t k = lo; k < hi; ++k) {
      const T gk = sgn * g[k];
      const T prod = gk * prev[k];
      // sign(prod) mapped to etaplus / etaminus / 1, as PyTorch's three masked fills.
      const T factor = prod > T(0) ? etaplus : (prod < T(0) ? etaminus : T(1));
      T s = ss[k] * factor;
      s = s < lo_s ? lo_s : s;
      s = s > hi_s ? hi_s : s;
      ss[k] = s;
      const T gc = prod < T(0) ? T(0) : gk;
      const T sg = static_cast<T>(gc > T(0)) - static_cast<T>(gc < T(0));
      p[k] = p[k] + T(-1) * sg * s;
      prev[k] = gc;
    }
  }
};

}  // namespace dtrain::optim::internal

namespace dtrain::optim {
template class TypedFunctionalOptimizer<RpropOptions>;
}  // namespace dtrain::optim
