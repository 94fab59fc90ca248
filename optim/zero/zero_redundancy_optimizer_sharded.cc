// ZeroRedundancyOptimizer's sharded checkpoints (checkpoint/sharded.h): each rank saves and loads
// only the state of the ranges it owns. Split from zero_redundancy_optimizer.cc to keep files small.
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "checkpoint/sharded.h"
#include "optim/zero/internal/layout.h"
#include "optim/zero/internal/state.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::optim {

std::map<int64_t, partition::Range> ZeroRedundancyOptimizer::owned_ranges() const {
  return internal::owned_ranges(layout_->entries());
}

checkpoint::ShardedState ZeroRedundancyOptimizer::sharded_state() {
  return internal::sharded_from_local(synced_local_state_dict(), layout_->entries(),
                                      layout_->params(), layout_->group_counts());
}

void ZeroRedundancyOptimizer::load_sharded_state(const checkpoint::ShardedState& state) {
  absl::StatusOr<std::vector<checkpoint::ParamGroup>> groups = checkpoint::parse_param_groups(
      state.param_groups, "load_sharded_state: the state's param groups");
  TORCH_CHECK(groups.ok(), groups.status().message());
  // A sharded state is keyed by global parameter index, as the file's.
  std::vector<int64_t> file_index;
  for (const internal::LocalEntry& e : layout_->entries()) file_index.push_back(e.param);
  load_local_state(
      *groups,
      internal::local_state_from_sharded(state, layout_->entries(), layout_->params(), rank()),
      file_index);
}

absl::Status ZeroRedundancyOptimizer::save_sharded(const std::string& dir,
                                                   const c10::IValue& extra) {
  checkpoint::ShardedState mine = sharded_state();
  mine.extra = extra;
  return checkpoint::save_sharded(options_.group, dir, mine, layout_->sharded_kind());
}

absl::StatusOr<c10::IValue> ZeroRedundancyOptimizer::load_sharded(const std::string& dir) {
  absl::StatusOr<checkpoint::ShardedInfo> info = checkpoint::read_sharded_info(dir);
  if (!info.ok()) return info.status();
  absl::Status fits =
      internal::check_sharded_info(*info, dir, layout_->params(), layout_->group_counts());
  if (!fits.ok()) return fits;
  std::map<int64_t, partition::Range> wanted;
  for (const auto& [param, range] : owned_ranges()) {
    if (info->shapes.count(param) > 0) wanted[param] = range;
  }
  absl::StatusOr<checkpoint::ShardedState> state = checkpoint::load_sharded(dir, wanted);
  if (!state.ok()) return state.status();
  try {
    load_sharded_state(*state);
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("ZeRO checkpoint ", dir, ": ", e.what_without_backtrace()));
  }
  return state->extra;
}

}  // namespace dtrain::optim
