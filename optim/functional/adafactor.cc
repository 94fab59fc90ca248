#include "optim/functional/adafactor.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "optim/functional/internal/optimizer_impl.h"

namespace dtrain::optim::internal {
namespace {

// Adafactor's own messages: "<what> should be >= <bound> but is: <v>".
OptionRule<double> at_least(const char* what, double bound, const char* bound_text) {
  return [=](const double& v) {
    TORCH_CHECK(v >= bound, what, " should be >= ", bound_text, " but is: ", python_float_repr(v));
  };
}

// torch.finfo(dtype).eps.
double machine_epsilon(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble:
      return std::numeric_limits<double>::epsilon();
    case at::kFloat:
      return std::numeric_limits<float>::epsilon();
    case at::kHalf:
      return std::ldexp(1.0, -10);
    case at::kBFloat16:
      return std::ldexp(1.0, -7);
    default:
      TORCH_CHECK(false, "Adafactor: parameters of dtype ", dtype,
                  " have no machine epsilon for eps1=None; use "
                  "floating-point parameters or give eps1");
  }
}

std::vector<int64_t> with_one_at(const at::Tensor& p, int64_t dim) {
  std::vector<int64_t> shape = p.sizes().vec();
  shape[static_cast<size_t>(dim < 0 ? dim + p.dim() : dim)] = 1;
  return shape;
}

}  // namespace

template <>
struct Descriptor<AdafactorOptions> : DescriptorDefaults {
  // The second moment of a matrix is factored into row and column statistics: a slice is not.
  static constexpr bool kWholeParameters = true;
  static OptionTable<AdafactorOptions> options() {
    return OptionTable<AdafactorOptions>("Adafactor", AdafactorOptions())
        .option(DTRAIN_OPTION(lr), at_least("Learning rate", 0.0, "0"))
        .option(DTRAIN_OPTION(beta2_decay),
                [](const double& v) {
                  TORCH_CHECK(v <= 0.0,
                              "beta2_decay should be <= 0 but is: ", python_float_repr(v));
                })
        .option(
            DTRAIN_OPTION(eps),
            [](const OptionalDoublePair& eps) {
              const auto& [eps1, eps2] = eps;
              TORCH_CHECK(!eps1 || *eps1 >= 0.0,
                          "epsilon1 should be >= 0 but is: ", python_float_repr(eps1.value_or(0)));
              TORCH_CHECK(eps2 >= 0.0, "epsilon2 should be >= 0 but is: ", python_float_repr(eps2));
            })
        .option(DTRAIN_OPTION(d), at_least("Clipping threshold d", 1.0, "1"))
        .option(DTRAIN_OPTION(weight_decay), at_least("weight_decay", 0.0, "0"))
        .foreach ()
        .maximize();
  }
  static constexpr bool kFused = false;
  static constexpr StepKind kStep = StepKind::kFloatTensor;
  static constexpr std::array<const char*, 4> kSlots = {"row_var", "col_var", "variance", ""};

  template <typename Self>
  static std::vector<int64_t> slot_shape_of(size_t slot, const at::Tensor& p) {
    if (slot == 0 && p.dim() > 1) return with_one_at(p, -1);
    if (slot == 1 && p.dim() > 1) return with_one_at(p, -2);
    return p.sizes().vec();
  }
  // A loaded state of the other kind (variance for a matrix, row_var for a vector) is refused
  // before anything changes; PyTorch fails with an AssertionError in the middle of its step.
  static void require_state(const std::string& name, const ParamState& s, const at::Tensor& p,
                            size_t index, const AdafactorOptions&) {
    if (!s.initialized) return;
    const bool factored = p.dim() > 1;
    TORCH_CHECK(factored ? s.slots[0].defined() && s.slots[1].defined() : s.slots[2].defined(),
                name, ": parameter ", index, " has ", p.dim(), " dimensions, so its state needs ",
                factored ? "'row_var' and 'col_var'" : "'variance'",
                ", which the loaded state dict does not "
                "have; load a state dict saved for these parameters");
  }
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor& g,
                      const AdafactorOptions&) {
    const bool fresh = !s.initialized;
    if (fresh) {
      s.initialized = true;
      s.step = 0;
      if (g.dim() > 1) {
        s.slots[0] = at::zeros(with_one_at(g, -1), g.options());  // p.grad.new_zeros(row_shape)
        s.slots[1] = at::zeros(with_one_at(g, -2), g.options());
      } else {
        s.slots[2] = zeros_like_param(g);
      }
    }
    s.step += 1;
    return fresh;
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const AdafactorOptions& o,
                   bool) {
    const at::Tensor grad = o.maximize() ? g.neg() : g;
    const double eps1 = std::get<0>(o.eps()).value_or(machine_epsilon(p.scalar_type()));
    const double eps2 = std::get<1>(o.eps());
    const double step = static_cast<double>(s.step);
    const double one_minus_beta2_t = std::pow(step, o.beta2_decay());
    const double rho_t = std::min(o.lr(), 1 / std::pow(step, 0.5));
    const double numel = static_cast<double>(p.numel());
    const double param_rms = at::linalg_vector_norm(p, 2).item<double>() / std::pow(numel, 0.5);
    const double alpha = std::max(eps2, param_rms) * rho_t;
    if (o.weight_decay() != 0) p.mul_(1 - o.lr() * o.weight_decay());
    at::Tensor var_estimate;
    if (grad.dim() > 1) {
      at::Tensor& row_var = s.slots[0];
      at::Tensor& col_var = s.slots[1];
      // (g * g).mean(dim) without materialising g * g, as PyTorch computes it.
      const at::Tensor row_mean =
          at::linalg_vector_norm(grad, 2, {-1}, /*keepdim=*/true).square_().div_(grad.size(-1));
      row_var.lerp_(row_mean, one_minus_beta2_t);
      const at::Tensor col_mean =
          at::linalg_vector_norm(grad, 2, {-2}, /*keepdim=*/true).square_().div_(grad.size(-2));
      col_var.lerp_(col_mean, one_minus_beta2_t);
      var_estimate = at::matmul(row_var, col_var);
      var_estimate.div_(row_var.mean({-2}, /*keepdim=*/true).clamp_(eps1));
    } else {
      at::Tensor& variance = s.slots[2];
      variance.lerp_(grad * grad, one_minus_beta2_t);
      var_estimate = variance.clone();
    }
    // eps1 squared: the square root comes after.
    at::Tensor update = var_estimate.clamp_(eps1 * eps1).rsqrt_();
    update.mul_(grad);
    const double update_rms =
        at::linalg_vector_norm(update, 2).item<double>() / (std::pow(numel, 0.5) * o.d());
    const double denom = std::max(1.0, update_rms);
    p.add_(update, -alpha / denom);
  }
};

}  // namespace dtrain::optim::internal

namespace dtrain::optim {
template class TypedFunctionalOptimizer<AdafactorOptions>;
}  // namespace dtrain::optim
