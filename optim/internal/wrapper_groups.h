// The param groups of an optimizer that wraps another (PostLocalSGDOptimizer, DiLoCo): the
// wrapper starts with a copy of the wrapped optimizer's groups, and their options are copied to
// the wrapped one before its step (LR schedulers act on the wrapper's groups) and back after (the
// wrapped optimizer may change them itself); and the refusal of wrapped optimizers whose
// parameters such a wrapper cannot overwrite (param_remainders). Package-private.
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

// Throws c10::Error "<who>: ..." when `inner`'s defaults or one of its param groups ask for
// param_remainders (Adam's and AdamW's bfloat16 parameters with an int16 remainder, which
// together hold float32 master weights: optim/functional/adam.h). Such a wrapper writes new
// values into the bfloat16 parameters (an average, the outer step's global parameters) that no
// remainder was split from: each master would become its new bfloat16 value joined with a stale
// remainder. `writes` says what the wrapper writes there.
void check_no_param_remainders(const torch::optim::Optimizer& inner, const char* who,
                               const char* writes);

}  // namespace dtrain::optim::internal

#endif  // DTRAIN_OPTIM_INTERNAL_WRAPPER_GROUPS_H_
