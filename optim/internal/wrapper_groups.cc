#include "optim/internal/wrapper_groups.h"

namespace dtrain::optim::internal {

std::vector<torch::optim::OptimizerParamGroup> copy_param_groups(
    const torch::optim::Optimizer& optim) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& g : optim.param_groups()) groups.emplace_back(g);
  return groups;
}

void copy_group_options(const std::vector<torch::optim::OptimizerParamGroup>& from,
                        std::vector<torch::optim::OptimizerParamGroup>& to) {
  TORCH_CHECK(from.size() == to.size(), "copy_group_options: ", from.size(), " groups vs ",
              to.size());
  for (size_t g = 0; g < from.size(); ++g) to[g].set_options(from[g].options().clone());
}

}  // namespace dtrain::optim::internal
