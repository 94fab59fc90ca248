#include "optim/model_averagers.h"

#include <iostream>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

namespace dtrain::optim {

ModelAverager::ModelAverager(comm::Group group) : group_(std::move(group)) {
  TORCH_CHECK(group_.is_member(),
              "model averager: the process group is not set or this rank is not in it");
}

void ModelAverager::average_parameters(
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  std::vector<at::Tensor> params;
  for (const auto& g : groups) params.insert(params.end(), g.params().begin(), g.params().end());
  average_parameters(params);
}

void average_parameters(const std::vector<at::Tensor>& params, const comm::Group& group) {
  if (!group.is_member()) return;  // PyTorch: do not update any parameter if not in the group
  std::vector<at::Tensor> chosen;
  for (const auto& p : params) {
    if (p.defined() && p.grad().defined()) chosen.push_back(p);
  }
  // Every rank has the same parameters with gradients (as in PyTorch), so all skip together.
  if (chosen.empty()) return;
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> flat_parts;
  for (const auto& p : chosen) flat_parts.push_back(p.detach().reshape(-1));
  // Mixed dtypes are promoted for the reduction and restored when copying back, as PyTorch does.
  at::Tensor flat = at::cat(flat_parts);
  flat.div_(group.size());
  std::vector<at::Tensor> t = {flat};
  group->allreduce(t)->wait();
  int64_t offset = 0;
  for (auto& p : chosen) {
    p.detach().copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
}

PeriodicModelAverager::PeriodicModelAverager(int64_t period, int64_t warmup_steps,
                                             comm::Group group)
    : ModelAverager(std::move(group)), period_(period), warmup_steps_(warmup_steps) {
  TORCH_CHECK(warmup_steps >= 0, "Arg ``warmup_steps`` must be a non-negative number.");
  TORCH_CHECK(period >= 1, "Arg ``period`` must be a positive value.");
  if (period == 1) {
    TORCH_WARN(
        "When period is 1, no need to use model averaging because the communication cost of "
        "all-reducing "
        "parameters will be no less than the cost of all-reducing gradients by "
        "DistributedDataParallel in "
        "the backward pass. Therefore, only DistributedDataParallel should be used for this case.");
  }
}

void PeriodicModelAverager::average_parameters(const std::vector<at::Tensor>& params) {
  if (step_ >= warmup_steps_ && (step_ - warmup_steps_) % period_ == 0) {
    ::dtrain::optim::average_parameters(params, group_);
  }
  ++step_;
}

HierarchicalModelAverager::HierarchicalModelAverager(
    std::vector<std::pair<int64_t, int>> period_group_size, int64_t warmup_steps, comm::Group group)
    : ModelAverager(std::move(group)), warmup_steps_(warmup_steps) {
  TORCH_CHECK(!period_group_size.empty(), "Arg ``period_group_size_dict`` must not be empty.");
  TORCH_CHECK(period_group_size.front().first > 0,
              "The minimum period in arg ``period_group_size_dict`` must be a positive value.");
  const int overall = group_.size();
  TORCH_CHECK(period_group_size.back().second == overall,
              "The last value in arg ``period_process_group_dict`` ",
              period_group_size.back().second,
              " must be equal to the size of arg ``process_group`` ", overall, ".");
  TORCH_CHECK(warmup_steps >= 0, "Arg ``warmup_steps`` must be a non-negative number.");
  for (size_t i = 1; i < period_group_size.size(); ++i) {
    TORCH_CHECK(period_group_size[i].first > period_group_size[i - 1].first &&
                    period_group_size[i].second >= period_group_size[i - 1].second,
                "``period_group_size_dict`` levels must have increasing periods and non-decreasing "
                "group sizes, got (",
                period_group_size[i - 1].first, ", ", period_group_size[i - 1].second, ") then (",
                period_group_size[i].first, ", ", period_group_size[i].second, ")");
  }
  if (period_group_size.back().first == 1) {
    TORCH_WARN(
        "When the maximum period in arg ``period_group_size_dict`` is 1, no need to use model "
        "averaging; "
        "only DistributedDataParallel should be used for this case.");
  }
  for (const auto& [period, size] : period_group_size) {
    TORCH_CHECK(size >= 1 && overall % size == 0, "group size ", size,
                " does not divide the process group's size ", overall);
    periods_.push_back(period);
    if (size == overall) {
      groups_.push_back(group_);
    } else {
      auto sub = comm::new_subgroups(group_, size);
      TORCH_CHECK(sub.ok(), "HierarchicalModelAverager: ", sub.status().ToString());
      groups_.push_back(sub->mine);
    }
  }
}

void HierarchicalModelAverager::average_parameters(const std::vector<at::Tensor>& params) {
  if (step_ >= warmup_steps_) {
    // The highest level whose period divides the step wins.
    for (size_t i = periods_.size(); i-- > 0;) {
      if (step_ % periods_[i] == 0) {
        ::dtrain::optim::average_parameters(params, groups_[i]);
        break;
      }
    }
  }
  ++step_;
}

}  // namespace dtrain::optim
