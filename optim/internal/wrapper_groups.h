// The param groups of an optimizer that wraps another (PostLocalSGDOptimizer, DiLoCo): the
// wrapper starts with a copy of the wrapped optimizer's groups, and their options are copied to
// the wrapped one before its step (LR schedulers act on the wrapper's groups) and back after (the
// wrapped optimizer may change them itself). Package-private.
//
//   Wrapper(std::unique_ptr<Optimizer> inner)
//       : Optimizer(copy_param_groups(*inner), inner->defaults().clone()) ...
//   copy_group_options(param_groups(), inner_->param_groups());   // before inner_->step()
//   copy_group_options(inner_->param_groups(), param_groups());   // after
#ifndef DTRAIN_OPTIM_INTERNAL_WRAPPER_GROUPS_H_
#define DTRAIN_OPTIM_INTERNAL_WRAPPER_GROUPS_H_

#include <vector>

#include <torch/optim/optimizer.h>

namespace dtrain::optim::internal {

// Copies of `optim`'s param groups (the same parameter tensors, cloned options).
std::vector<torch::optim::OptimizerParamGroup> copy_param_groups(
    const torch::optim::Optimizer& optim);

// Each group's options of `from` cloned into the same group of `to`; the callers check first
// that both have as many groups (with their own message), and this checks it again.
void copy_group_options(const std::vector<torch::optim::OptimizerParamGroup>& from,
                        std::vector<torch::optim::OptimizerParamGroup>& to);

}  // namespace dtrain::optim::internal

#endif  // DTRAIN_OPTIM_INTERNAL_WRAPPER_GROUPS_H_
