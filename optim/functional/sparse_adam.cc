#include "optim/functional/sparse_adam.h"

#include <cmath>
#include <sstream>

#include "optim/functional/internal/optimizer_impl.h"

namespace dtrain::optim::internal {
namespace {

OptionRule<double> positive(const char* what) {
  return [what](const double& v) { TORCH_CHECK(v > 0.0, what, ": ", python_float_repr(v)); };
}

}  // namespace

template <>
struct Descriptor<SparseAdamOptions> : DescriptorDefaults {
  static OptionTable<SparseAdamOptions> options() {
    // SparseAdam wants lr and eps strictly positive.
    return OptionTable<SparseAdamOptions>("SparseAdam", SparseAdamOptions())
        .option(DTRAIN_OPTION(lr), positive("Invalid learning rate"))
        .betas()
        .option(DTRAIN_OPTION(eps), positive("Invalid epsilon value"))
        .maximize()
        .check_order({"lr", "eps", "betas"});
  }
  static constexpr bool kFused = false;
  static constexpr bool kSparseGradients = true;
  static constexpr StepKind kStep = StepKind::kInt;
  static constexpr std::array<const char*, 4> kSlots = {"exp_avg", "exp_avg_sq", "", ""};

  // PyTorch's constructor check; its parameter indices are [group, index] pairs (one group here).
  static void check_params(const std::string&, const std::vector<at::Tensor>& params) {
    std::ostringstream complex;
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].is_complex())
        complex << (complex.tellp() > 0 ? ", " : "") << "[0, " << i << "]";
    }
    TORCH_CHECK(complex.tellp() == 0, "Complex params at indices [", complex.str(),
                "]: SparseAdam does not support complex parameters");
  }
  static bool prepare(ParamState& s, const at::Tensor& p, const at::Tensor&,
                      const SparseAdamOptions&) {
    return count_step(s, p, {true, true, false, false});  // counts a gradient without values too
  }
  static void aten(ParamState& s, at::Tensor& p, const at::Tensor& g, const SparseAdamOptions& o,
                   bool) {
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    const at::Tensor grad =
        (o.maximize() ? g.neg() : g).coalesce();  // the update is non-linear: unique indices
    const at::Tensor grad_indices = grad._indices();
    const at::Tensor grad_values = grad._values();
    if (grad_values.numel() == 0) return;
    // grad.new(indices, values, size)
    auto make_sparse = [&](const at::Tensor& values) {
      return at::sparse_coo_tensor(grad_indices, values, grad.sizes());
    };
    at::Tensor& exp_avg = s.slots[0];
    at::Tensor& exp_avg_sq = s.slots[1];
    // old <- b * old + (1 - b) * new  <==>  old += (1 - b) * (new - old)
    const at::Tensor old_exp_avg_values = exp_avg.sparse_mask(grad)._values();
    at::Tensor exp_avg_update_values = grad_values.sub(old_exp_avg_values).mul_(1 - beta1);
    exp_avg.add_(make_sparse(exp_avg_update_values));
    const at::Tensor old_exp_avg_sq_values = exp_avg_sq.sparse_mask(grad)._values();
    at::Tensor exp_avg_sq_update_values =
        grad_values.pow(2).sub_(old_exp_avg_sq_values).mul_(1 - beta2);
    exp_avg_sq.add_(make_sparse(exp_avg_sq_update_values));
    // Dense addition again, as PyTorch: the new moments' values without another sparse_mask.
    at::Tensor numer = exp_avg_update_values.add_(old_exp_avg_values);
    exp_avg_sq_update_values.add_(old_exp_avg_sq_values);
    const at::Tensor denom = exp_avg_sq_update_values.sqrt_().add_(o.eps());
    const double step = static_cast<double>(s.step);
    const double bias_correction1 = 1 - std::pow(beta1, step);
    const double bias_correction2 = 1 - std::pow(beta2, step);
    const double step_size = o.lr() * std::sqrt(bias_correction2) / bias_correction1;
    p.add_(make_sparse(numer.div_(denom).mul(-step_size)));
  }
};

}  // namespace dtrain::optim::internal

namespace dtrain::optim {
template class TypedFunctionalOptimizer<SparseAdamOptions>;
}  // namespace dtrain::optim
