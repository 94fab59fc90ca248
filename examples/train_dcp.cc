#include "examples/train_dcp.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/dcp.h"
#include "checkpoint/dcp_state.h"
#include "checkpoint/optimizer_state_dict.h"
#include "examples/train_checkpoint.h"

namespace dtrain::examples {
namespace {

constexpr char kStepKey[] = "step";
// PostLocalSGDOptimizer's averager step: where PyTorch's PostLocalSGDOptimizer.state_dict() has
// it ({"state", "param_groups", "step"} under "optim"), so dcp_to_torch_save gives PyTorch's dict.
constexpr char kAveragerStepKey[] = "optim.step";

// The model's parameter names and shapes, in the optimizer's parameter order.
void names_and_shapes(Trainer& t, std::vector<std::string>* names,
                      std::vector<std::vector<int64_t>>* shapes) {
  for (const auto& item : t.model->named_parameters()) {
    names->push_back(item.key());
    shapes->push_back(item.value().sizes().vec());
  }
}

// A whole number >= 0 the checkpoint holds under `key`; `fallback` when it holds none.
absl::StatusOr<int64_t> count_in(const checkpoint::DcpReader& reader, const std::string& dir,
                                 const std::string& key, int64_t fallback) {
  if (reader.metadata().objects.count(key) == 0) return fallback;
  absl::StatusOr<c10::IValue> v = reader.value(key);
  if (!v.ok()) return v.status();
  if (!v->isInt() || v->toInt() < 0) {
    return absl::DataLossError(
        absl::StrCat("DCP checkpoint ", dir, ": '", key, "' is not a whole number >= 0"));
  }
  return v->toInt();
}

// The averager's step: saved by dtrain; for a checkpoint without one (PyTorch's DCP drops
// PostLocalSGDOptimizer's "step"), the training step -- train() steps the averager once a step.
absl::StatusOr<int64_t> averager_step(const checkpoint::DcpReader& reader, const std::string& dir) {
  absl::StatusOr<int64_t> step = count_in(reader, dir, kStepKey, 0);
  if (!step.ok()) return step;
  return count_in(reader, dir, kAveragerStepKey, *step);
}

}  // namespace

absl::Status save_train_dcp(const Job& job, Trainer& t, int64_t step, const std::string& dir) {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  names_and_shapes(t, &names, &shapes);
  std::vector<checkpoint::DcpWriteItem> items;
  const bool coordinator = job.rank == 0;
  if (coordinator) {
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& item : t.model->named_parameters())
      named.emplace_back(item.key(), item.value().detach());
    items = checkpoint::dcp_model_items(named);
    items.push_back(checkpoint::DcpWriteItem::object(kStepKey, step));
  }
  absl::StatusOr<std::vector<checkpoint::DcpWriteItem>> optimizer;
  if (t.opt.zero) {
    optimizer = checkpoint::dcp_optimizer_items(t.opt.zero->sharded_state(), names, coordinator);
  } else if (coordinator) {  // plain Adam, or post-local SGD's (rank 0's, as PyTorch's DCP keeps)
    const c10::IValue whole = t.opt.global_state_dict();
    absl::StatusOr<checkpoint::OptimizerStateDict> sd =
        checkpoint::parse_optimizer_state_dict(whole, "the optimizer's state dict");
    optimizer = sd.ok() ? checkpoint::dcp_optimizer_items(
                              checkpoint::whole_sharded_state(*sd, shapes), names, true)
                        : absl::StatusOr<std::vector<checkpoint::DcpWriteItem>>(sd.status());
    if (optimizer.ok() && t.opt.post_local) {
      optimizer->push_back(checkpoint::DcpWriteItem::object(
          kAveragerStepKey, whole.toGenericDict().at(kStepKey),
          checkpoint::DcpPath{std::string("optim"), std::string("step")}));
    }
  } else {
    optimizer = std::vector<checkpoint::DcpWriteItem>();
  }
  // A rank that cannot make its items still takes part (with none), so that the save's verdict,
  // not a hang, reports it; its own error wins.
  if (optimizer.ok()) items.insert(items.end(), optimizer->begin(), optimizer->end());
  const absl::Status saved = checkpoint::save_dcp(job.world, dir, items);
  return optimizer.ok() ? saved : optimizer.status();
}

absl::StatusOr<int64_t> load_train_dcp(Trainer& t, const std::string& dir, bool with_model) {
  absl::StatusOr<checkpoint::DcpReader> reader = checkpoint::DcpReader::open(dir);
  if (!reader.ok()) return reader.status();
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  names_and_shapes(t, &names, &shapes);
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string key = absl::StrCat("model.", names[i]);
    auto it = reader->metadata().tensors.find(key);
    if (it == reader->metadata().tensors.end() || it->second.size != shapes[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DCP checkpoint ", dir,
          (it == reader->metadata().tensors.end() ? " has no " : " has another shape for "), key,
          "; was it written for this model (--hidden)?"));
    }
  }
  if (with_model) {
    absl::StatusOr<c10::impl::GenericDict> model = checkpoint::load_dcp_model(*reader, names);
    if (!model.ok()) return model.status();
    if (absl::Status s = load_weights(*model, *t.model); !s.ok()) return s;
  }
  std::map<int64_t, partition::Range> wanted;
  if (t.opt.zero) {
    wanted = t.opt.zero->owned_ranges();
  } else {
    for (size_t i = 0; i < shapes.size(); ++i) {
      int64_t n = 1;
      for (int64_t d : shapes[i]) n *= d;
      wanted[static_cast<int64_t>(i)] = {0, n};
    }
  }
  absl::StatusOr<checkpoint::ShardedState> state =
      checkpoint::load_dcp_optimizer(*reader, names, wanted, shapes);
  if (!state.ok()) return state.status();
  if (t.opt.zero) {
    t.opt.zero->load_sharded_state(*state);
  } else {
    absl::StatusOr<std::vector<checkpoint::ParamGroup>> groups =
        checkpoint::parse_param_groups(state->param_groups, absl::StrCat(dir, "'s param groups"));
    if (!groups.ok()) return groups.status();
    checkpoint::OptimizerStateDict sd;
    sd.param_groups = *groups;
    for (const auto& [index, p] : state->params) sd.state.emplace(index, p.entries);
    c10::IValue whole = checkpoint::to_ivalue(sd);
    if (t.opt.post_local) {
      absl::StatusOr<int64_t> averaged = averager_step(*reader, dir);
      if (!averaged.ok()) return averaged.status();
      whole.toGenericDict().insert(kStepKey, *averaged);
    }
    t.opt.load_state_dict(whole);
  }
  return count_in(*reader, dir, kStepKey, 0);
}

}  // namespace dtrain::examples
