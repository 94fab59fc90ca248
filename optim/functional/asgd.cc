#include "optim/functional/asgd.h"

#include <algorithm>
#include <cmath>

#include "optim/functional/internal/optimizer_impl.h"

namespace dtrain::optim::internal {

template <>
struct Descriptor<ASGDOptions> : DescriptorDefaults {
  static OptionTable<ASGDOptions> options() {
    return OptionTable<ASGDOptions>("ASGD", ASGDOptions())
        .lr()
        .option(DTRAIN_OPTION(lambd))
        .option(DTRAIN_OPTION(alpha))
        .option(DTRAIN_OPTION(t0))
        .weight_decay()
        .foreach ()
        .maximize()
        .differentiable()
        .fixed("capturable", false);
  }
  static constexpr StepKind kStep = StepKind::kFloatTensor;
  // PyTorch's key order: step, eta, mu, ax.
  static constexpr std::array<const char*, 4> kSlots = {"eta", "mu", "ax", ""};
  static constexpr std::array<bool, 4> kScalarSlots = {true, true, false, false};

  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&, const ASGDOptions& o) {
    const bool fresh = count_step(s, p, {false, false, true, false});
    if (fresh) {  // float32 scalars on the CPU, as PyTorch's
      s.slots[0] = at::scalar_tensor(o.lr(), at::kFloat);
      s.slots[1] = at::ones({}, at::kFloat);
    }
    return fresh;
  }
  // c[0]: eta, c[1]: mu, both as they were before this step.
  static void scalars(std::array<double, 4>& c, const ParamState& s, const ASGDOptions&) {
    c[0] = s.slots[0].item<double>();
    c[1] = s.slots[1].item<double>();
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const ASGDOptions& o, bool) {
    at::Tensor grad = o.maximize() ? g.neg() : g;
    if (o.weight_decay() != 0) grad = grad.add(p, o.weight_decay());
    const double eta = s.slots[0].item<double>();
    p.mul_(1 - o.lambd() * eta);
    p.add_(grad, -eta);
    at::Tensor& ax = s.slots[2];
    if (s.slots[1].item<double>() != 1) {
      ax.add_(p.sub(ax).mul_(s.slots[1]));
    } else {
      ax.copy_(p);
    }
  }
  // After the update: eta and mu for the next step. PyTorch copies torch.as_tensor(value) into
  // them: a float32 tensor (the default dtype), so a value is rounded to float32 even where the
  // slot is float64 (after load_state_dict).
  static void finish(ParamState& s, const ASGDOptions& o) {
    const double step = static_cast<double>(s.step);
    const double eta = o.lr() / std::pow(1 + o.lambd() * o.lr() * step, o.alpha());
    const double mu = 1 / std::max(1.0, step - o.t0());
    s.slots[0].fill_(static_cast<double>(static_cast<float>(eta)));
    s.slots[1].fill_(static_cast<double>(static_cast<float>(mu)));
  }
  template <typename T, bool kAverage>
  static void loop(const FusedTensor<T>& t, int64_t lo, int64_t hi, const ASGDOptions& o) {
    T* __restrict p = t.p;
    const T* __restrict g = t.g;
    T* __restrict ax = t.s[2];
    const T wd = static_cast<T>(o.weight_decay());
    const T decay = static_cast<T>(1 - o.lambd() * t.c[0]);
    const T neg_eta = static_cast<T>(-t.c[0]);
    const T mu = static_cast<T>(t.c[1]);
    const T sign = o.maximize() ? T(-1) : T(1);
    for (int64_t k = lo; k < hi; ++k) {
      const T gk = sign * g[k] + wd * p[k];
      T pk = p[k] * decay;
      pk = pk + neg_eta * gk;
      p[k] = pk;
      ax[k] = kAverage ? ax[k] + (pk - ax[k]) * mu : pk;
    }
  }
  template <typename T>
  static void kernel(const FusedTensor<T>& t, int64_t lo, int64_t hi, const ASGDOptions& o) {
    return t.c[1] != 1 ? loop<T, true>(t, lo, hi, o) : loop<T, false>(t, lo, hi, o);
  }
};

}  // namespace dtrain::optim::internal

namespace dtrain::optim {
template class TypedFunctionalOptimizer<ASGDOptions>;
}  // namespace dtrain::optim
