#include "optim/functional_optimizers.h"

#include <cmath>
#include <sstream>

#include <ATen/ATen.h>

#include "optim/internal/fused.h"
#include "optim/libtorch_compat.h"

namespace dtrain::optim {
namespace {

using internal::FusedTensor;

// Python's repr of a float, for PyTorch's error messages ("Invalid learning rate: -0.1").
std::string py(double v) {
  std::ostringstream os;
  os.precision(17);
  for (int p = 1; p <= 17; ++p) {
    std::ostringstream t;
    t.precision(p);
    t << v;
    if (std::stod(t.str()) == v || std::isnan(v)) {
      std::string s = t.str();
      if (s.find_first_of(".einn") == std::string::npos) s += ".0";
      return s;
    }
  }
  os << v;
  return os.str();
}

double get_double(const OptionsDict& d, const char* key) {
  const c10::IValue& v = d.at(key);
  TORCH_CHECK(v.isDouble() || v.isInt(), "option '", key, "' must be a number, got ", v.tagKind());
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}
bool get_bool(const OptionsDict& d, const char* key) {
  const c10::IValue& v = d.at(key);
  TORCH_CHECK(v.isBool(), "option '", key, "' must be a bool, got ", v.tagKind());
  return v.toBool();
}
std::tuple<double, double> get_pair(const OptionsDict& d, const char* key) {
  const c10::IValue& v = d.at(key);
  std::vector<c10::IValue> items;
  if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) items.push_back(e);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) items.push_back(e);
  } else if (v.isDoubleList()) {
    for (double e : v.toDoubleVector()) items.emplace_back(e);
  }
  TORCH_CHECK(items.size() == 2 && (items[0].isDouble() || items[0].isInt()) &&
                  (items[1].isDouble() || items[1].isInt()),
              "option '", key, "' must be a pair of numbers");
  auto num = [](const c10::IValue& e) { return e.isDouble() ? e.toDouble() : static_cast<double>(e.toInt()); };
  return {num(items[0]), num(items[1])};
}
c10::IValue pair(const std::tuple<double, double>& t) {
  return c10::ivalue::Tuple::create({std::get<0>(t), std::get<1>(t)});
}

void check_lr(double lr) { TORCH_CHECK(lr >= 0.0, "Invalid learning rate: ", py(lr)); }
void check_eps(double eps) { TORCH_CHECK(eps >= 0.0, "Invalid epsilon value: ", py(eps)); }
void check_wd(double wd) { TORCH_CHECK(wd >= 0.0, "Invalid weight_decay value: ", py(wd)); }
void check_betas(const std::tuple<double, double>& b) {
  TORCH_CHECK(std::get<0>(b) >= 0.0 && std::get<0>(b) < 1.0, "Invalid beta parameter at index 0: ", py(std::get<0>(b)));
  TORCH_CHECK(std::get<1>(b) >= 0.0 && std::get<1>(b) < 1.0, "Invalid beta parameter at index 1: ", py(std::get<1>(b)));
}

// The same kernel compiled for AVX2 (chosen at run time on CPUs that have it): every call inside is
// inlined into this function, so the loops are vectorised 8 floats wide instead of SSE2's 4. No FMA
// (a multiply-add stays two roundings), so results are bit-identical to the baseline kernel's.
template <typename Traits, typename T, typename Options>
__attribute__((target("avx2"), flatten)) void kernel_avx2(const FusedTensor<T>& t, int64_t lo, int64_t hi,
                                                          const Options& o) {
  Traits::template kernel<T>(t, lo, hi, o);
}

// Runs one optimizer's update over (index, gradient) pairs: Traits::prepare on each (lazy state,
// step count), then the fused kernel over all contiguous float/double tensors in one parallel
// pass, and Traits::aten (ATen operations, PyTorch's exact sequence) over the rest.
template <typename Traits, typename Options>
void drive(std::vector<at::Tensor>& params, std::vector<ParamState>& state, const Options& o,
           const std::vector<std::pair<size_t, at::Tensor>>& work) {
  std::vector<FusedTensor<float>> f32;
  std::vector<FusedTensor<double>> f64;
  for (const auto& [i, g] : work) {
    ParamState& s = state[i];
    const bool first = Traits::prepare(s, params[i], g, o);
    if (internal::fusable(params[i], g, s.slots)) {
      auto fill = [&](auto& list, auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        FusedTensor<T> t;
        t.p = params[i].template data_ptr<T>();
        t.g = g.template data_ptr<T>();
        for (size_t k = 0; k < 4; ++k) t.s[k] = s.slots[k].defined() ? s.slots[k].template data_ptr<T>() : nullptr;
        t.n = params[i].numel();
        t.first = first;
        Traits::scalars(t.c, s, o);
        list.push_back(t);
      };
      if (params[i].scalar_type() == at::kFloat) {
        fill(f32, static_cast<float*>(nullptr));
      } else {
        fill(f64, static_cast<double*>(nullptr));
      }
    } else {
      Traits::aten(s, params[i], g, o, first);
    }
  }
  const bool avx2 = internal::cpu_has_avx2();
  internal::for_each_range(f32, [&](const FusedTensor<float>& t, int64_t lo, int64_t hi) {
    avx2 ? kernel_avx2<Traits>(t, lo, hi, o) : Traits::template kernel<float>(t, lo, hi, o);
  });
  internal::for_each_range(f64, [&](const FusedTensor<double>& t, int64_t lo, int64_t hi) {
    avx2 ? kernel_avx2<Traits>(t, lo, hi, o) : Traits::template kernel<double>(t, lo, hi, o);
  });
}

std::vector<std::pair<size_t, at::Tensor>> defined_grads(const std::vector<at::Tensor>& grads) {
  std::vector<std::pair<size_t, at::Tensor>> work;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined()) work.emplace_back(i, grads[i]);
  }
  return work;
}

at::Tensor zeros_like_param(const at::Tensor& p) { return at::zeros_like(p, at::MemoryFormat::Preserve); }

// ---------------------------------------------------------------------------------------- SGD
struct SGDTraits {
  // Returns true when the momentum buffer is new: the first update copies d_p into it.
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&, const SGDOptions& o) {
    s.initialized = true;
    if (o.momentum() != 0 && !s.slots[0].defined()) {
      s.slots[0] = at::empty_like(p, at::MemoryFormat::Preserve);
      return true;
    }
    return false;
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& grad, const SGDOptions& o, bool fresh) {
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
    if (t.s[0] == nullptr) return loop<T, false, false, false>(t, lo, hi, o);
    if (t.first) {
      return o.nesterov() ? loop<T, true, true, true>(t, lo, hi, o) : loop<T, true, true, false>(t, lo, hi, o);
    }
    return o.nesterov() ? loop<T, true, false, true>(t, lo, hi, o) : loop<T, true, false, false>(t, lo, hi, o);
  }
};

// ----------------------------------------------------------------------------- Adam and AdamW
template <bool kDecoupled, typename Options>
struct AdamTraitsT {
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&, const Options& o) {
    const bool fresh = !s.initialized;
    if (fresh) {
      s.initialized = true;
      s.step = 0;
      s.slots[0] = zeros_like_param(p);
      s.slots[1] = zeros_like_param(p);
      if (o.amsgrad()) s.slots[2] = zeros_like_param(p);
    }
    if (o.amsgrad() && !s.slots[2].defined()) s.slots[2] = zeros_like_param(p);  // amsgrad turned on later
    s.step += 1;
    return fresh;
  }
  static void scalars(std::array<double, 4>& c, const ParamState& s, const Options& o) {
    const double step = static_cast<double>(s.step);
    const double bc1 = 1 - std::pow(std::get<0>(o.betas()), step);
    const double bc2 = 1 - std::pow(std::get<1>(o.betas()), step);
    c[0] = o.lr() / bc1;      // step_size
    c[1] = std::sqrt(bc2);    // bias_correction2_sqrt
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const Options& o, bool) {
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    at::Tensor grad = o.maximize() ? g.neg() : g;
    if (kDecoupled) {
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
  template <typename T>
  static void kernel(const FusedTensor<T>& t, int64_t lo, int64_t hi, const Options& o) {
    T* __restrict p = t.p;
    const T* __restrict g = t.g;
    T* __restrict m = t.s[0];
    T* __restrict v = t.s[1];
    T* __restrict vmax = t.s[2];
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    const T b1 = static_cast<T>(beta1), one_minus_b1 = static_cast<T>(1 - beta1);
    const T b2 = static_cast<T>(beta2), one_minus_b2 = static_cast<T>(1 - beta2);
    const T wd = static_cast<T>(o.weight_decay());
    const T decay = static_cast<T>(1 - o.lr() * o.weight_decay());
    const T eps = static_cast<T>(o.eps());
    const T neg_step_size = static_cast<T>(-t.c[0]);
    const T bc2_sqrt = static_cast<T>(t.c[1]);
    const T sign = o.maximize() ? T(-1) : T(1);
    if (vmax == nullptr) {
      for (int64_t k = lo; k < hi; ++k) {
        T pk = p[k];
        T gk = sign * g[k];
        if (kDecoupled) {
          pk = pk * decay;
        } else {
          gk = gk + wd * pk;
        }
        const T mk = m[k] * b1 + one_minus_b1 * gk;
        const T vk = v[k] * b2 + one_minus_b2 * gk * gk;
        m[k] = mk;
        v[k] = vk;
        const T denom = std::sqrt(vk) / bc2_sqrt + eps;
        p[k] = pk + neg_step_size * mk / denom;
      }
    } else {
      for (int64_t k = lo; k < hi; ++k) {
        T pk = p[k];
        T gk = sign * g[k];
        if (kDecoupled) {
          pk = pk * decay;
        } else {
          gk = gk + wd * pk;
        }
        const T mk = m[k] * b1 + one_minus_b1 * gk;
        const T vk = v[k] * b2 + one_minus_b2 * gk * gk;
        const T vm = vk > vmax[k] ? vk : vmax[k];
        m[k] = mk;
        v[k] = vk;
        vmax[k] = vm;
        const T denom = std::sqrt(vm) / bc2_sqrt + eps;
        p[k] = pk + neg_step_size * mk / denom;
      }
    }
  }
};
using AdamTraits = AdamTraitsT<false, AdamOptions>;
using AdamWTraits = AdamTraitsT<true, AdamWOptions>;

// ------------------------------------------------------------------------------------ Adagrad
struct AdagradTraits {
  static void init(ParamState& s, const at::Tensor& p, const AdagradOptions& o) {
    s.initialized = true;
    s.step = 0;
    s.slots[0] = at::full_like(p, o.initial_accumulator_value(), at::MemoryFormat::Preserve);
  }
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&, const AdagradOptions& o) {
    const bool fresh = !s.initialized;
    if (fresh) init(s, p, o);
    s.step += 1;
    return fresh;
  }
  static void scalars(std::array<double, 4>& c, const ParamState& s, const AdagradOptions& o) {
    c[0] = o.lr() / (1 + (static_cast<double>(s.step) - 1) * o.lr_decay());  // clr
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const AdagradOptions& o, bool) {
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
};

// ----------------------------------------------------------------------------------- Adadelta
struct AdadeltaTraits {
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&, const AdadeltaOptions&) {
    const bool fresh = !s.initialized;
    if (fresh) {
      s.initialized = true;
      s.step = 0;
      s.slots[0] = zeros_like_param(p);
      s.slots[1] = zeros_like_param(p);
    }
    s.step += 1;
    return fresh;
  }
  static void scalars(std::array<double, 4>&, const ParamState&, const AdadeltaOptions&) {}
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const AdadeltaOptions& o, bool) {
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

// ------------------------------------------------------------------------------------- Adamax
struct AdamaxTraits {
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&, const AdamaxOptions&) {
    const bool fresh = !s.initialized;
    if (fresh) {
      s.initialized = true;
      s.step = 0;
      s.slots[0] = zeros_like_param(p);
      s.slots[1] = zeros_like_param(p);
    }
    s.step += 1;
    return fresh;
  }
  static void scalars(std::array<double, 4>& c, const ParamState& s, const AdamaxOptions& o) {
    c[0] = o.lr() / (1 - std::pow(std::get<0>(o.betas()), static_cast<double>(s.step)));  // clr
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const AdamaxOptions& o, bool) {
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    at::Tensor grad = o.maximize() ? g.neg() : g;
    if (o.weight_decay() != 0) grad = grad.add(p, o.weight_decay());
    at::Tensor& exp_avg = s.slots[0];
    at::Tensor& exp_inf = s.slots[1];
    exp_avg.mul_(beta1).add_(grad, 1 - beta1);
    at::Tensor norm_buf = at::cat({exp_inf.mul_(beta2).unsqueeze(0), grad.abs().add_(o.eps()).unsqueeze_(0)}, 0);
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
    const T b1 = static_cast<T>(beta1), one_minus_b1 = static_cast<T>(1 - beta1), b2 = static_cast<T>(beta2);
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

// ------------------------------------------------------------------------------------ RMSprop
struct RMSpropTraits {
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&, const RMSpropOptions& o) {
    const bool fresh = !s.initialized;
    if (fresh) {
      s.initialized = true;
      s.step = 0;
      s.slots[0] = zeros_like_param(p);
      if (o.momentum() > 0) s.slots[1] = zeros_like_param(p);
      if (o.centered()) s.slots[2] = zeros_like_param(p);
    }
    // PyTorch would fail with a KeyError if momentum/centered are switched on after the first
    // step; start those buffers at zero instead.
    if (o.momentum() > 0 && !s.slots[1].defined()) s.slots[1] = zeros_like_param(p);
    if (o.centered() && !s.slots[2].defined()) s.slots[2] = zeros_like_param(p);
    s.step += 1;
    return fresh;
  }
  static void scalars(std::array<double, 4>&, const ParamState&, const RMSpropOptions&) {}
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const RMSpropOptions& o, bool) {
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

// -------------------------------------------------------------------------------------- Rprop
struct RpropTraits {
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor& g, const RpropOptions& o) {
    const bool fresh = !s.initialized;
    if (fresh) {
      s.initialized = true;
      s.step = 0;
      s.slots[0] = zeros_like_param(p);
      s.slots[1] = at::full_like(g, o.lr());
    }
    s.step += 1;
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
    const T etaminus = static_cast<T>(std::get<0>(o.etas())), etaplus = static_cast<T>(std::get<1>(o.etas()));
    const T lo_s = static_cast<T>(std::get<0>(o.step_sizes())), hi_s = static_cast<T>(std::get<1>(o.step_sizes()));
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

}  // namespace

// -------------------------------------------------------------------- options: check, to/from dict
template <>
void TypedFunctionalOptimizer<SGDOptions>::check(const SGDOptions& o) {
  check_lr(o.lr());
  TORCH_CHECK(o.momentum() >= 0.0, "Invalid momentum value: ", py(o.momentum()));
  check_wd(o.weight_decay());
  TORCH_CHECK(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0),
              "Nesterov momentum requires a momentum and zero dampening");
}
template <>
OptionsDict TypedFunctionalOptimizer<SGDOptions>::to_dict(const SGDOptions& o) {
  OptionsDict d = new_options_dict();
  d.insert("lr", o.lr());
  d.insert("momentum", o.momentum());
  d.insert("dampening", o.dampening());
  d.insert("weight_decay", o.weight_decay());
  d.insert("nesterov", o.nesterov());
  d.insert("maximize", o.maximize());
  d.insert("foreach", c10::IValue());
  d.insert("differentiable", false);
  return d;
}
template <>
SGDOptions TypedFunctionalOptimizer<SGDOptions>::from_dict(const OptionsDict& d) {
  return SGDOptions(get_double(d, "lr"))
      .momentum(get_double(d, "momentum"))
      .dampening(get_double(d, "dampening"))
      .weight_decay(get_double(d, "weight_decay"))
      .nesterov(get_bool(d, "nesterov"))
      .maximize(get_bool(d, "maximize"));
}

#define DTRAIN_ADAM_LIKE_OPTIONS(Options, extra_to, extra_from)                              \
  template <>                                                                               \
  void TypedFunctionalOptimizer<Options>::check(const Options& o) {                         \
    check_lr(o.lr());                                                                       \
    check_eps(o.eps());                                                                     \
    check_betas(o.betas());                                                                 \
    check_wd(o.weight_decay());                                                             \
  }                                                                                         \
  template <>                                                                               \
  OptionsDict TypedFunctionalOptimizer<Options>::to_dict(const Options& o) {                \
    OptionsDict d = new_options_dict();                                                     \
    d.insert("lr", o.lr());                                                                 \
    d.insert("betas", pair(o.betas()));                                                     \
    d.insert("eps", o.eps());                                                               \
    d.insert("weight_decay", o.weight_decay());                                             \
    extra_to;                                                                               \
    d.insert("maximize", o.maximize());                                                     \
    d.insert("foreach", c10::IValue());                                                     \
    return d;                                                                               \
  }                                                                                         \
  template <>                                                                               \
  Options TypedFunctionalOptimizer<Options>::from_dict(const OptionsDict& d) {              \
    Options o;                                                                              \
    o.lr(get_double(d, "lr")).betas(get_pair(d, "betas")).eps(get_double(d, "eps"));        \
    o.weight_decay(get_double(d, "weight_decay")).maximize(get_bool(d, "maximize"));        \
    extra_from;                                                                             \
    return o;                                                                               \
  }

DTRAIN_ADAM_LIKE_OPTIONS(AdamOptions, d.insert("amsgrad", o.amsgrad()); d.insert("capturable", false);
                         d.insert("differentiable", false); d.insert("fused", false),
                         o.amsgrad(get_bool(d, "amsgrad")))
DTRAIN_ADAM_LIKE_OPTIONS(AdamWOptions, d.insert("amsgrad", o.amsgrad()); d.insert("capturable", false),
                         o.amsgrad(get_bool(d, "amsgrad")))
DTRAIN_ADAM_LIKE_OPTIONS(AdamaxOptions, (void)0, (void)0)
#undef DTRAIN_ADAM_LIKE_OPTIONS

template <>
void TypedFunctionalOptimizer<AdagradOptions>::check(const AdagradOptions& o) {
  check_lr(o.lr());
  TORCH_CHECK(o.lr_decay() >= 0.0, "Invalid lr_decay value: ", py(o.lr_decay()));
  check_wd(o.weight_decay());
  TORCH_CHECK(o.initial_accumulator_value() >= 0.0, "Invalid initial_accumulator_value value: ",
              py(o.initial_accumulator_value()));
  check_eps(o.eps());
}
template <>
OptionsDict TypedFunctionalOptimizer<AdagradOptions>::to_dict(const AdagradOptions& o) {
  OptionsDict d = new_options_dict();
  d.insert("lr", o.lr());
  d.insert("lr_decay", o.lr_decay());
  d.insert("eps", o.eps());
  d.insert("weight_decay", o.weight_decay());
  d.insert("initial_accumulator_value", o.initial_accumulator_value());
  d.insert("foreach", c10::IValue());
  d.insert("maximize", o.maximize());
  return d;
}
template <>
AdagradOptions TypedFunctionalOptimizer<AdagradOptions>::from_dict(const OptionsDict& d) {
  return AdagradOptions()
      .lr(get_double(d, "lr"))
      .lr_decay(get_double(d, "lr_decay"))
      .eps(get_double(d, "eps"))
      .weight_decay(get_double(d, "weight_decay"))
      .initial_accumulator_value(get_double(d, "initial_accumulator_value"))
      .maximize(get_bool(d, "maximize"));
}

template <>
void TypedFunctionalOptimizer<AdadeltaOptions>::check(const AdadeltaOptions& o) {
  check_lr(o.lr());
  TORCH_CHECK(o.rho() >= 0.0 && o.rho() <= 1.0, "Invalid rho value: ", py(o.rho()));
  check_eps(o.eps());
  check_wd(o.weight_decay());
}
template <>
OptionsDict TypedFunctionalOptimizer<AdadeltaOptions>::to_dict(const AdadeltaOptions& o) {
  OptionsDict d = new_options_dict();
  d.insert("lr", o.lr());
  d.insert("rho", o.rho());
  d.insert("eps", o.eps());
  d.insert("weight_decay", o.weight_decay());
  d.insert("maximize", o.maximize());
  d.insert("foreach", c10::IValue());
  return d;
}
template <>
AdadeltaOptions TypedFunctionalOptimizer<AdadeltaOptions>::from_dict(const OptionsDict& d) {
  return AdadeltaOptions()
      .lr(get_double(d, "lr"))
      .rho(get_double(d, "rho"))
      .eps(get_double(d, "eps"))
      .weight_decay(get_double(d, "weight_decay"))
      .maximize(get_bool(d, "maximize"));
}

template <>
void TypedFunctionalOptimizer<RMSpropOptions>::check(const RMSpropOptions& o) {
  check_lr(o.lr());
  check_eps(o.eps());
  TORCH_CHECK(o.momentum() >= 0.0, "Invalid momentum value: ", py(o.momentum()));
  check_wd(o.weight_decay());
  TORCH_CHECK(o.alpha() >= 0.0, "Invalid alpha value: ", py(o.alpha()));
}
template <>
OptionsDict TypedFunctionalOptimizer<RMSpropOptions>::to_dict(const RMSpropOptions& o) {
  OptionsDict d = new_options_dict();
  d.insert("lr", o.lr());
  d.insert("momentum", o.momentum());
  d.insert("alpha", o.alpha());
  d.insert("eps", o.eps());
  d.insert("centered", o.centered());
  d.insert("weight_decay", o.weight_decay());
  d.insert("foreach", c10::IValue());
  d.insert("maximize", o.maximize());
  d.insert("differentiable", false);
  return d;
}
template <>
RMSpropOptions TypedFunctionalOptimizer<RMSpropOptions>::from_dict(const OptionsDict& d) {
  return RMSpropOptions()
      .lr(get_double(d, "lr"))
      .momentum(get_double(d, "momentum"))
      .alpha(get_double(d, "alpha"))
      .eps(get_double(d, "eps"))
      .centered(get_bool(d, "centered"))
      .weight_decay(get_double(d, "weight_decay"))
      .maximize(get_bool(d, "maximize"));
}

template <>
void TypedFunctionalOptimizer<RpropOptions>::check(const RpropOptions& o) {
  check_lr(o.lr());
  const auto [etaminus, etaplus] = o.etas();
  TORCH_CHECK(0.0 < etaminus && etaminus < 1.0 && 1.0 < etaplus, "Invalid eta values: ", py(etaminus),
              ", ", py(etaplus));
}
template <>
OptionsDict TypedFunctionalOptimizer<RpropOptions>::to_dict(const RpropOptions& o) {
  OptionsDict d = new_options_dict();
  d.insert("lr", o.lr());
  d.insert("etas", pair(o.etas()));
  d.insert("step_sizes", pair(o.step_sizes()));
  d.insert("foreach", c10::IValue());
  d.insert("maximize", o.maximize());
  return d;
}
template <>
RpropOptions TypedFunctionalOptimizer<RpropOptions>::from_dict(const OptionsDict& d) {
  return RpropOptions()
      .lr(get_double(d, "lr"))
      .etas(get_pair(d, "etas"))
      .step_sizes(get_pair(d, "step_sizes"))
      .maximize(get_bool(d, "maximize"));
}

// ---------------------------------------------------------------------------- the eight classes
#define DTRAIN_DEFINE_FUNCTIONAL(Class, Options, Traits, kStep, n0, n1, n2, none_slots)       \
  Class::Class(std::vector<at::Tensor> params, Options options)                              \
      : TypedFunctionalOptimizer<Options>(std::move(params), std::move(options)) {           \
    check(options_);                                                                         \
    init_eagerly();                                                                          \
  }                                                                                          \
  void Class::update(size_t index, const at::Tensor& grad) {                                 \
    drive<Traits>(params_, state_, options_, {{index, grad}});                               \
  }                                                                                          \
  void Class::update_all(const std::vector<at::Tensor>& grads) {                             \
    drive<Traits>(params_, state_, options_, defined_grads(grads));                          \
  }                                                                                          \
  FunctionalOptimizer::StepKind Class::step_kind() const { return StepKind::kStep; }         \
  std::array<const char*, 4> Class::slot_names() const { return {n0, n1, n2, ""}; }          \
  bool Class::none_for_undefined_slots() const { return none_slots; }

#define init_eagerly() (void)0
// SGD keeps momentum_buffer=None for parameters without a buffer in PyTorch 1.13, no entry in 2.x.
DTRAIN_DEFINE_FUNCTIONAL(FunctionalSGD, SGDOptions, SGDTraits, kNone, "momentum_buffer", "", "",
                         kSgdStateKeepsNoneMomentumBuffer)
DTRAIN_DEFINE_FUNCTIONAL(FunctionalAdam, AdamOptions, AdamTraits, kFloatTensor, "exp_avg", "exp_avg_sq", "max_exp_avg_sq", false)
DTRAIN_DEFINE_FUNCTIONAL(FunctionalAdamW, AdamWOptions, AdamWTraits, kFloatTensor, "exp_avg", "exp_avg_sq", "max_exp_avg_sq", false)
DTRAIN_DEFINE_FUNCTIONAL(FunctionalAdadelta, AdadeltaOptions, AdadeltaTraits, kInt, "square_avg", "acc_delta", "", false)
DTRAIN_DEFINE_FUNCTIONAL(FunctionalAdamax, AdamaxOptions, AdamaxTraits, kFloatTensor, "exp_avg", "exp_inf", "", false)
DTRAIN_DEFINE_FUNCTIONAL(FunctionalRMSprop, RMSpropOptions, RMSpropTraits, kInt, "square_avg", "momentum_buffer", "grad_avg", false)
DTRAIN_DEFINE_FUNCTIONAL(FunctionalRprop, RpropOptions, RpropTraits, kInt, "prev", "step_size", "", false)
#undef init_eagerly
// Adagrad creates its state for every parameter at construction, as PyTorch's does.
#define init_eagerly() \
  for (size_t i = 0; i < params_.size(); ++i) AdagradTraits::init(state_[i], params_[i], options_)
DTRAIN_DEFINE_FUNCTIONAL(FunctionalAdagrad, AdagradOptions, AdagradTraits, kFloatTensor, "sum", "", "", false)
#undef init_eagerly
#undef DTRAIN_DEFINE_FUNCTIONAL

namespace internal {
bool fusable(const at::Tensor& param, const at::Tensor& grad, const std::array<at::Tensor, 4>& slots) {
  const auto dtype = param.scalar_type();
  if (!param.device().is_cpu() || (dtype != at::kFloat && dtype != at::kDouble)) return false;
  if (!param.is_contiguous() || !grad.is_contiguous() || grad.scalar_type() != dtype) return false;
  for (const auto& s : slots) {
    if (s.defined() && (!s.is_contiguous() || s.scalar_type() != dtype)) return false;
  }
  return true;
}
}  // namespace internal

}  // namespace dtrain::optim
