// FlatLayout: element ranges of one flat buffer per rank (see layout.h).
#include "optim/zero/internal/layout.h"

#include <algorithm>

#include <ATen/ATen.h>

namespace dtrain::optim::internal {

FlatLayout::FlatLayout(const std::vector<std::vector<at::Tensor>>& groups, comm::Group group,
                       int64_t alignment)
    : ZeroLayout(groups, std::move(group)) {
  std::vector<int64_t> numels;
  std::vector<size_t> group_of;
  for (size_t g = 0; g < group_sizes_.size(); ++g) {
    numels.insert(numels.end(), group_sizes_[g].begin(), group_sizes_[g].end());
    group_of.insert(group_of.end(), group_sizes_[g].size(), g);
  }
  absl::StatusOr<partition::FlatPartition> fp =
      partition::flat_partition(numels, world_size(), alignment);
  TORCH_CHECK(fp.ok(), "ZeroRedundancyOptimizer: ", fp.status().message());
  ranges_ = fp->ranges;
  // The whole-parameter view, for introspection: a parameter belongs to the rank holding its
  // first element.
  partition_.world_size = world_size();
  partition_.params_per_rank.assign(world_size(),
                                    std::vector<std::vector<int64_t>>(group_sizes_.size()));
  partition_.owner.assign(numels.size(), -1);
  partition_.numel_per_rank.assign(world_size(), 0);
  for (int r = 0; r < world_size(); ++r) partition_.numel_per_rank[r] = ranges_[r].size();
  int64_t offset = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    int r = 0;
    while (r + 1 < world_size() && ranges_[r].end <= offset) ++r;
    partition_.owner[i] = r;
    partition_.params_per_rank[r][group_of[i]].push_back(static_cast<int64_t>(i));
    offset += numels[i];
  }
  // This rank's pieces, grouped by parameter group (flat order within a group).
  std::vector<std::pair<LocalEntry, int64_t>> pieces;
  for (const auto& s : fp->slices[rank()]) {
    pieces.push_back(
        {LocalEntry{s.param_index, {s.begin, s.end}, group_of[s.param_index], /*slice=*/true},
         s.flat_offset});
  }
  std::stable_sort(pieces.begin(), pieces.end(),
                   [](const auto& a, const auto& b) { return a.first.group < b.first.group; });
  // Every parameter becomes a view of one buffer.
  int64_t total = 0;
  for (const auto& p : params_) {
    offsets_.push_back(total);
    total += p.numel();
  }
  buffer_ = at::empty({std::max<int64_t>(total, 1)}, params_[0].options());
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    at::Tensor view = buffer_.narrow(0, offsets_[i], p.numel()).view(p.sizes());
    view.copy_(p.detach());
    p.set_data(view);
  }
  for (const auto& [entry, flat_offset] : pieces) {
    entries_.push_back(entry);
    piece_offsets_.push_back(flat_offset);
    piece_tensors_.push_back(buffer_.narrow(0, flat_offset, entry.range.size()));
  }
}

std::vector<at::Tensor> FlatLayout::local_tensors(size_t group) const {
  std::vector<at::Tensor> out;
  for (size_t k = 0; k < entries_.size(); ++k) {
    if (entries_[k].group == group) out.push_back(piece_tensors_[k]);
  }
  return out;
}

at::Tensor FlatLayout::step_and_sync(torch::optim::Optimizer& local,
                                     torch::optim::Optimizer::LossClosure closure) {
  at::Tensor loss = evaluate_closure(closure);
  // Each piece's gradient is the matching slice of its parameter's gradient (a view when the
  // gradient is contiguous); frozen or unused parameters leave their pieces without one.
  for (size_t k = 0; k < entries_.size(); ++k) {
    const LocalEntry& e = entries_[k];
    const at::Tensor& grad = params_[static_cast<size_t>(e.param)].grad();
    piece_tensors_[k].mutable_grad() =
        grad.defined() ? grad.reshape(-1).narrow(0, e.range.begin, e.range.size()) : at::Tensor();
  }
  local.step();
  c10::NoGradGuard no_grad;
  Works works;
  comm::C10dGroup& pg = *group_.pg();
  for (int r = 0; r < world_size(); ++r) {
    if (ranges_[r].size() == 0) continue;
    c10d::BroadcastOptions bo;
    bo.rootRank = r;
    std::vector<at::Tensor> t = {wire_view(buffer_.narrow(0, ranges_[r].begin, ranges_[r].size()))};
    works.push_back(pg.broadcast(t, bo));
  }
  wait_all(works);
  return loss;
}

void FlatLayout::check_can_add_group() const {
  TORCH_CHECK(
      false,
      "add_param_group is not supported with PartitionStrategy::kFlat yet (the flat buffer and "
      "every "
      "rank's range would move); create the optimizer with all groups, or use kSortedGreedy");
}

void FlatLayout::add_group(const std::vector<at::Tensor>&) { check_can_add_group(); }

c10::IValue FlatLayout::consolidation_part(const c10::IValue& local_state_dict) const {
  return rekeyed_state_dict(local_state_dict, piece_offsets_, all_group_params(group_counts()));
}

c10::IValue FlatLayout::assemble_consolidated(const c10::IValue& merged) const {
  return assemble_pieces(merged, offsets_, params_);
}

}  // namespace dtrain::optim::internal
