#include "optim/internal/wrapper_groups.h"

#include "optim/functional/adapter.h"
#include "optim/functional/state_precision.h"

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

namespace {

bool asks_param_remainders(const torch::optim::OptimizerOptions& options) {
  const auto* dict = dynamic_cast<const DictOptions*>(&options);
  if (dict == nullptr || !dict->dict().contains(kParamRemaindersKey)) return false;
  const c10::IValue v = dict->dict().at(kParamRemaindersKey);
  return v.isBool() && v.toBool();
}

}  // namespace

void check_no_param_remainders(const torch::optim::Optimizer& inner, const char* who,
                               const char* writes) {
  int64_t group = -1;  // -1: the defaults
  bool asks = asks_param_remainders(inner.defaults());
  for (size_t g = 0; !asks && g < inner.param_groups().size(); ++g) {
    const auto& pg = inner.param_groups()[g];
    asks = pg.has_options() && asks_param_remainders(pg.options());
    if (asks) group = static_cast<int64_t>(g);
  }
  TORCH_CHECK(!asks, who, ": the wrapped optimizer keeps param_remainders=True (",
              group < 0 ? std::string("its defaults") : "param group " + std::to_string(group),
              "): its bfloat16 parameters and int16 remainders hold float32 master weights, but ",
              who, " ", writes,
              " into the bfloat16 parameters only, which would join each with a remainder split "
              "from another value and corrupt the master weights; give the wrapped optimizer "
              "param_remainders=False (float32 parameters with state_dtype='bfloat16' or '8bit' "
              "keep its state small), or train without ",
              who);
}

}  // namespace dtrain::optim::internal
