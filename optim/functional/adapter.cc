#include "optim/functional/adapter.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "checkpoint/optimizer_state_dict.h"
#include "optim/functional/registry.h"
#include "optim/functional/state_checks.h"

namespace dtrain::optim {

double DictOptions::get_lr() const {
  TORCH_CHECK(options_.contains("lr"), "these optimizer options have no 'lr'");
  const c10::IValue& v = options_.at("lr");
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}

void DictOptions::set_lr(const double lr) { options_.insert_or_assign("lr", lr); }

FunctionalOptimizerAdapter::GivenOptions FunctionalOptimizerAdapter::given_options(
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  GivenOptions given;
  for (const auto& g : groups) given.push_back(g.has_options() ? g.options().clone() : nullptr);
  return given;
}

FunctionalOptimizerAdapter::FunctionalOptimizerAdapter(
    std::vector<torch::optim::OptimizerParamGroup> param_groups, std::string name,
    OptionsDict defaults)
    : FunctionalOptimizerAdapter(param_groups, given_options(param_groups), std::move(name),
                                 std::move(defaults)) {}

FunctionalOptimizerAdapter::FunctionalOptimizerAdapter(
    std::vector<torch::optim::OptimizerParamGroup> param_groups, GivenOptions given,
    std::string name, OptionsDict defaults)
    : torch::optim::Optimizer(std::move(param_groups),
                              std::make_unique<DictOptions>(std::move(defaults))),
      name_(std::move(name)) {
  for (size_t g = 0; g < given.size() && g < param_groups_.size(); ++g) {
    if (given[g] != nullptr) param_groups_[g].set_options(std::move(given[g]));
  }
  TORCH_CHECK(FunctionalRegistry::global().contains(name_),
              "FunctionalOptimizerAdapter: no functional "
              "optimizer named '",
              name_, "' is registered");
  sync_groups();  // validates the options now, not at the first step
}

FunctionalOptimizerAdapter::FunctionalOptimizerAdapter(std::vector<at::Tensor> params,
                                                       std::string name, OptionsDict defaults)
    : FunctionalOptimizerAdapter(
          std::vector<torch::optim::OptimizerParamGroup>{
              torch::optim::OptimizerParamGroup(std::move(params))},
          std::move(name), std::move(defaults)) {}

OptionsDict FunctionalOptimizerAdapter::group_options(size_t group) const {
  const auto& g = param_groups_[group];
  const torch::optim::OptimizerOptions& o = g.has_options() ? g.options() : *defaults_;
  if (auto* dict = dynamic_cast<const DictOptions*>(&o)) return dict->dict();
  return options_from_torch(o);  // a LibTorch twin's options (e.g. from ZeRO's wrapper)
}

void FunctionalOptimizerAdapter::sync_groups() {
  // add_param_group is not virtual in LibTorch: new groups are noticed here.
  for (size_t g = functionals_.size(); g < param_groups_.size(); ++g) {
    OptionsDict options = group_options(g);
    // A LibTorch param group may be empty (a ZeroRedundancyOptimizer rank that owns no parameter):
    // the functional optimizer is asked to accept that, as PyTorch's ZeRO asks its functional
    // local optimizer with _allow_empty_param_list=True. Only for an empty group, so a user's
    // factory sees the key only where it matters.
    if (param_groups_[g].params().empty()) {
      options = options.copy();
      options.insert_or_assign(kAllowEmptyParamList, true);
    }
    functionals_.push_back(
        FunctionalRegistry::global().create(name_, param_groups_[g].params(), options));
  }
  for (size_t g = 0; g < functionals_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    const auto& mine = functionals_[g]->params();
    bool same = params.size() == mine.size();
    for (size_t i = 0; same && i < params.size(); ++i) same = params[i].is_same(mine[i]);
    TORCH_CHECK(same, "FunctionalOptimizerAdapter: the parameters of group ", g,
                " changed after it was created; add a new param group instead");
    functionals_[g]->set_options(group_options(g));  // picks up scheduler changes
  }
}

FunctionalOptimizer& FunctionalOptimizerAdapter::functional(size_t group) {
  sync_groups();
  TORCH_CHECK(group < functionals_.size(), "group ", group, " out of range (", functionals_.size(),
              ")");
  return *functionals_[group];
}

at::Tensor FunctionalOptimizerAdapter::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    c10::AutoGradMode enable(true);
    loss = closure();
  }
  sync_groups();
  for (size_t g = 0; g < functionals_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    std::vector<at::Tensor> grads;
    grads.reserve(params.size());
    for (const auto& p : params) grads.push_back(p.grad());
    functionals_[g]->step(grads);
  }
  return loss;
}

c10::IValue FunctionalOptimizerAdapter::state_dict() {
  sync_groups();
  // Each functional optimizer's one group, indices 0..n-1; concatenated, they number on.
  std::vector<checkpoint::OptimizerStateDict> parts;
  for (auto& f : functionals_) {
    absl::StatusOr<checkpoint::OptimizerStateDict> part =
        checkpoint::parse_optimizer_state_dict(f->state_dict(), f->name() + ".state_dict()");
    TORCH_CHECK(part.ok(), part.status().message());
    parts.push_back(*std::move(part));
  }
  return checkpoint::to_ivalue(checkpoint::concatenate(parts));
}

void FunctionalOptimizerAdapter::load_state_dict(const c10::IValue& state_dict) {
  load_state_dict(state_dict, {});
}

void FunctionalOptimizerAdapter::load_state_dict(const c10::IValue& state_dict,
                                                 const std::vector<int64_t>& file_index) {
  sync_groups();
  const std::string what = name_ + ".load_state_dict";
  absl::StatusOr<checkpoint::OptimizerStateDict> sd =
      checkpoint::parse_optimizer_state_dict(state_dict, what + ": the state dict");
  TORCH_CHECK(sd.ok(), sd.status().message(), "; ", kLoadAdvice);
  TORCH_CHECK(sd->param_groups.size() == functionals_.size(), what, ": the state dict has ",
              sd->param_groups.size(), " parameter groups, this optimizer has ",
              functionals_.size(), "; ", kLoadAdvice);
  size_t count = 0;
  for (size_t g = 0; g < functionals_.size(); ++g) {
    const size_t here = param_groups_[g].params().size();
    TORCH_CHECK(sd->param_groups[g].params.size() == here, what, ": param_groups[", g, "] has ",
                sd->param_groups[g].params.size(), " parameters in the state dict and ", here,
                " here; ", kLoadAdvice);
    count += here;
  }
  TORCH_CHECK(file_index.empty() || file_index.size() == count, what, ": file_index has ",
              file_index.size(), " entries for ", count, " parameters");
  absl::Status indices = check_param_indices(*sd, count, what);
  TORCH_CHECK(indices.ok(), indices.message());
  // Every group checked and converted before any changes.
  std::vector<FunctionalOptimizer::Loaded> loaded;
  for (size_t g = 0; g < functionals_.size(); ++g) {
    FunctionalOptimizer::StateDictSource source;
    source.file_group = g;
    for (int64_t i : sd->param_groups[g].params) {
      source.file_index.push_back(file_index.empty() ? i : file_index.at(static_cast<size_t>(i)));
    }
    absl::StatusOr<FunctionalOptimizer::Loaded> group = functionals_[g]->build_loaded(
        checkpoint::to_ivalue(checkpoint::group_slice(*sd, g)), source);
    TORCH_CHECK(group.ok(), group.status().message());
    loaded.push_back(*std::move(group));
  }
  for (size_t g = 0; g < functionals_.size(); ++g) {
    functionals_[g]->commit_loaded(std::move(loaded[g]));
    // Keep the LibTorch-side group options in step with what was loaded.
    OptionsDict opts = functionals_[g]->options_dict();
    param_groups_[g].set_options(std::make_unique<DictOptions>(opts));
  }
}

}  // namespace dtrain::optim
