#include "optim/post_local_sgd_optimizer.h"

#include "optim/functional/adapter.h"
#include "optim/functional/torch_state.h"
#include "optim/internal/wrapper_groups.h"

namespace dtrain::optim {
using internal::copy_group_options;
using internal::copy_param_groups;

namespace {
constexpr char kAveragerWrites[] = "writes the model averager's averages";
}  // namespace

PostLocalSGDOptimizer::PostLocalSGDOptimizer(std::unique_ptr<torch::optim::Optimizer> optim,
                                             std::shared_ptr<ModelAverager> averager)
    : torch::optim::Optimizer(copy_param_groups(*optim), optim->defaults().clone()),
      optim_(std::move(optim)),
      averager_(std::move(averager)),
      synced_(optim_->param_groups().size()) {
  TORCH_CHECK(averager_ != nullptr, "PostLocalSGDOptimizer needs a model averager");
  internal::check_no_param_remainders(*optim_, "PostLocalSGDOptimizer", kAveragerWrites);
}

void PostLocalSGDOptimizer::sync_options(bool to_local) {
  auto& local = optim_->param_groups();
  // Groups added on either side since the last call (see the header) go to the other side, in one
  // order on both: the local optimizer's new groups first, then this one's.
  if (local.size() != synced_ || param_groups_.size() != synced_) {
    std::vector<torch::optim::OptimizerParamGroup> mine(param_groups_.begin() + synced_,
                                                        param_groups_.end());
    while (param_groups_.size() > synced_) param_groups_.pop_back();  // (groups are not assignable)
    for (size_t g = synced_; g < local.size(); ++g) param_groups_.emplace_back(local[g]);
    for (const auto& group : mine) {
      optim_->add_param_group(group);
      param_groups_.push_back(group);
    }
    synced_ = local.size();
  }
  TORCH_CHECK(local.size() == param_groups_.size(),
              "PostLocalSGDOptimizer: param groups out of step (", local.size(),
              " in the local optimizer, ", param_groups_.size(), " here)");
  if (to_local) {
    copy_group_options(param_groups_, local);
  } else {
    copy_group_options(local, param_groups_);
  }
}

at::Tensor PostLocalSGDOptimizer::step(LossClosure closure) {
  sync_options(/*to_local=*/true);  // LR schedulers act on this optimizer's groups
  // Also here: a group added since, or a loaded state dict's options, may ask for it.
  internal::check_no_param_remainders(*optim_, "PostLocalSGDOptimizer", kAveragerWrites);
  at::Tensor loss = optim_->step(std::move(closure));
  sync_options(/*to_local=*/false);
  averager_->average_parameters(optim_->param_groups());
  return loss;
}

c10::IValue PostLocalSGDOptimizer::state_dict() {
  sync_options(/*to_local=*/true);
  c10::IValue sd = optimizer_state_dict(*optim_);
  sd.toGenericDict().insert_or_assign("step", averager_->step());
  return sd;
}

void PostLocalSGDOptimizer::load_state_dict(const c10::IValue& state_dict) {
  auto sd = state_dict.toGenericDict();
  load_optimizer_state_dict(*optim_, state_dict);
  sync_options(/*to_local=*/false);
  if (sd.contains("step")) {
    averager_->set_step(sd.at("step").toInt());
  } else {
    TORCH_WARN(
        "Loaded state dict does not contain a step counter for an averager. Setting step counter "
        "to 0.");
    averager_->set_step(0);
  }
}

}  // namespace dtrain::optim
