#include "optim/functional/muon.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "optim/functional/internal/optimizer_impl.h"

namespace dtrain::optim::internal {
namespace {

// PyTorch's _zeropower_via_newtonschulz: a quintic Newton-Schulz iteration towards U V^T of
// grad = U S V^T, in bfloat16, on the wide orientation of the matrix.
at::Tensor zeropower_via_newtonschulz(const at::Tensor& grad, const DoubleTriple& coefficients,
                                      int64_t ns_steps, double eps) {
  const auto [a, b, c] = coefficients;
  at::Tensor ortho_grad = grad.to(at::kBFloat16);
  const bool tall = grad.size(0) > grad.size(1);
  if (tall) ortho_grad = ortho_grad.t();
  ortho_grad.div_(at::linalg_vector_norm(ortho_grad, 2).clamp(eps));
  for (int64_t i = 0; i < ns_steps; ++i) {
    const at::Tensor gram_matrix = at::matmul(ortho_grad, ortho_grad.t());
    const at::Tensor gram_update =
        at::addmm(gram_matrix, gram_matrix, gram_matrix, /*beta=*/b, /*alpha=*/c);
    ortho_grad = at::addmm(ortho_grad, gram_update, ortho_grad, /*beta=*/a);
  }
  if (tall) ortho_grad = ortho_grad.t();
  return ortho_grad;
}

// PyTorch's _adjust_lr, from the parameter's (A, B) shape.
double adjust_lr(double lr, const OptionalString& fn, at::IntArrayRef shape) {
  const double rows = static_cast<double>(shape[0]), cols = static_cast<double>(shape[1]);
  double ratio = 1.0;
  if (!fn || *fn == "original") {
    ratio = std::sqrt(std::max(1.0, rows / cols));
  } else if (*fn == "match_rms_adamw") {
    ratio = 0.2 * std::sqrt(std::max(rows, cols));
  } else if (*fn == "spectral_unclamped") {
    ratio = std::sqrt(rows / cols);
  }
  return lr * ratio;
}

OptionRule<double> at_least_zero(const char* what) {
  return [what](const double& v) {
    TORCH_CHECK(v >= 0.0, what, " should be >= 0 but is: ", python_float_repr(v));
  };
}

}  // namespace

template <>
struct Descriptor<MuonOptions> : DescriptorDefaults {
  // Newton-Schulz orthogonalises whole matrices.
  static constexpr bool kWholeParameters = true;
  static OptionTable<MuonOptions> options() {
    return OptionTable<MuonOptions>("Muon", MuonOptions())
        .option(DTRAIN_OPTION(lr), at_least_zero("Learning rate"))
        .option(DTRAIN_OPTION(weight_decay), at_least_zero("weight decay"))
        .option(DTRAIN_OPTION(momentum), at_least_zero("momentum"))
        .option(DTRAIN_OPTION(nesterov))
        .option(DTRAIN_OPTION(ns_coefficients))
        .option(DTRAIN_OPTION(eps))
        .option(
            DTRAIN_OPTION(ns_steps),
            [](const int64_t& steps) {
              TORCH_CHECK(
                  steps < 100,
                  "Number of steps must be less than 100 for computational efficiency (ns_steps=",
                  steps, "; PyTorch raises this at the first step)");
            })
        .option(DTRAIN_OPTION(adjust_lr_fn),
                [](const OptionalString& fn) {
                  TORCH_CHECK(!fn || *fn == "original" || *fn == "match_rms_adamw" ||
                                  *fn == "spectral_unclamped",
                              "Adjust learning rate function ", fn.value_or(""),
                              " is not supported (use None, 'original', "
                              "'match_rms_adamw' or 'spectral_unclamped')");
                })
        .check_order({"lr", "momentum", "weight_decay", "adjust_lr_fn"});
  }
  static constexpr bool kFused = false;
  static constexpr StepKind kStep = StepKind::kNone;
  static constexpr std::array<const char*, 4> kSlots = {"momentum_buffer", "", "", ""};

  static void check_params(const std::string&, const std::vector<at::Tensor>& params) {
    for (const at::Tensor& p : params) {
      if (p.dim() == 2) continue;
      std::ostringstream size;
      for (int64_t d = 0; d < p.dim(); ++d) size << (d > 0 ? ", " : "") << p.size(d);
      TORCH_CHECK(
          false,
          "Muon only supports 2D parameters whereas we found a parameter with size: torch.Size([",
          size.str(),
          "]) (give the other parameters -- biases, embeddings -- to an optimizer such as AdamW)");
    }
  }
  static bool prepare(ParamState& s, const at::Tensor&, const at::Tensor& g, const MuonOptions&) {
    const bool fresh = !s.initialized;
    if (fresh) {
      s.initialized = true;
      s.slots[0] = zeros_like_param(g);
    }
    return fresh;
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const MuonOptions& o, bool) {
    at::Tensor& buf = s.slots[0];
    buf.lerp_(g, 1 - o.momentum());
    at::Tensor update = o.nesterov() ? g.lerp(buf, o.momentum()) : buf;
    update = zeropower_via_newtonschulz(update, o.ns_coefficients(), o.ns_steps(), o.eps());
    const double adjusted_lr = adjust_lr(o.lr(), o.adjust_lr_fn(), p.sizes());
    p.mul_(1 - o.lr() * o.weight_decay());
    p.add_(update, -adjusted_lr);
  }
};

}  // namespace dtrain::optim::internal

namespace dtrain::optim {
template class TypedFunctionalOptimizer<MuonOptions>;
}  // namespace dtrain::optim
