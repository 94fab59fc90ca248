// WholeParamLayout: whole parameters per rank (see layout.h).
#include "optim/zero/internal/layout.h"

#include <algorithm>
#include <climits>

#include <ATen/ATen.h>

namespace dtrain::optim::internal {
namespace {

std::vector<bool> trainable_mask(const std::vector<at::Tensor>& params) {
  std::vector<bool> mask;
  for (const auto& p : params) mask.push_back(p.requires_grad());
  return mask;
}

}  // namespace

WholeParamLayout::WholeParamLayout(const std::vector<std::vector<at::Tensor>>& groups,
                                   comm::Group group,
                                   const std::vector<std::vector<int64_t>>& params_per_rank,
                                   bool bucket_view, int64_t chunk_bytes)
    : ZeroLayout(groups, std::move(group)), bucket_view_(bucket_view), chunk_bytes_(chunk_bytes) {
  assign(params_per_rank);
  build_buckets();
}

void WholeParamLayout::assign(const std::vector<std::vector<int64_t>>& params_per_rank) {
  absl::StatusOr<partition::ParamPartition> p =
      params_per_rank.empty()
          ? partition::sorted_greedy_partition(group_sizes_, world_size())
          : partition::manual_partition(group_sizes_, params_per_rank, world_size());
  TORCH_CHECK(p.ok(), "ZeroRedundancyOptimizer: ", p.status().message());
  partition_ = *std::move(p);
  entries_.clear();
  global_to_local_.assign(params_.size(), -1);
  const auto& mine = partition_.params_per_rank[rank()];
  for (size_t g = 0; g < mine.size(); ++g) {
    for (int64_t i : mine[g]) {
      global_to_local_[static_cast<size_t>(i)] = static_cast<int64_t>(entries_.size());
      entries_.push_back(
          LocalEntry{i, {0, params_[static_cast<size_t>(i)].numel()}, g, /*slice=*/false});
    }
  }
}

void WholeParamLayout::add_group(const std::vector<at::Tensor>& params) {
  group_sizes_.emplace_back();
  for (const auto& p : params) {
    params_.push_back(p);
    group_sizes_.back().push_back(p.numel());
  }
  // Sorted-greedy is deterministic and carries loads group to group: earlier groups keep their
  // owners, only the new group's parameters are placed.
  assign({});
  build_buckets();
}

std::vector<at::Tensor> WholeParamLayout::local_tensors(size_t group) const {
  std::vector<at::Tensor> out;
  for (int64_t i : partition_.params_per_rank[rank()][group])
    out.push_back(params_[static_cast<size_t>(i)]);
  return out;
}

void WholeParamLayout::build_buckets() {
  trainable_ = trainable_mask(params_);
  bucket_offset_.assign(params_.size(), -1);
  if (!bucket_view_) return;
  buckets_.assign(world_size(), at::Tensor());
  for (int r = 0; r < world_size(); ++r) {
    int64_t size = 0;
    std::vector<int64_t> members;
    for (const auto& g : partition_.params_per_rank[r]) {
      for (int64_t i : g) {
        at::Tensor& p = params_[static_cast<size_t>(i)];
        if (!p.requires_grad()) {
          // Leave the bucket: its own storage, so rebuilding does not destroy its values.
          p.set_data(p.detach().clone());
          continue;
        }
        members.push_back(i);
        size += p.numel();
      }
    }
    at::Tensor bucket = at::empty({std::max<int64_t>(size, 1)}, params_[0].options());
    int64_t offset = 0;
    for (int64_t i : members) {
      at::Tensor& p = params_[static_cast<size_t>(i)];
      at::Tensor view = bucket.narrow(0, offset, p.numel()).view(p.sizes());
      view.copy_(p.detach());
      p.set_data(view);
      bucket_offset_[static_cast<size_t>(i)] = offset;
      offset += p.numel();
    }
    buckets_[r] = bucket;
  }
}

void WholeParamLayout::broadcast(const std::vector<int64_t>& params, Works& works) const {
  comm::C10dGroup& pg = *group_.pg();
  c10::NoGradGuard no_grad;
  auto outside_bucket = [&](int64_t i) {
    return bucket_view_ && bucket_offset_[static_cast<size_t>(i)] < 0;
  };
  size_t k = 0;
  while (k < params.size()) {
    const int64_t first = params[k++];
    const int owner = partition_.owner.at(static_cast<size_t>(first));
    if (owner < 0 || outside_bucket(first)) continue;  // no owner, or frozen: nothing changes
    c10d::BroadcastOptions bo;
    bo.rootRank = owner;
    std::vector<at::Tensor> t = {params_[static_cast<size_t>(first)].detach()};
    if (bucket_view_) {
      const int64_t lo = bucket_offset_[static_cast<size_t>(first)];
      int64_t hi = lo + params_[static_cast<size_t>(first)].numel();
      for (; k < params.size() && partition_.owner.at(static_cast<size_t>(params[k])) == owner;
           ++k) {
        if (outside_bucket(params[k])) continue;
        if (bucket_offset_[static_cast<size_t>(params[k])] != hi) break;
        hi += params_[static_cast<size_t>(params[k])].numel();
      }
      t = {buckets_[owner].narrow(0, lo, hi - lo)};
    }
    t[0] = wire_view(t[0]);
    works.push_back(pg.broadcast(t, bo));
  }
}

bool WholeParamLayout::trainability_changed() const {
  return trainable_mask(params_) != trainable_;
}

at::Tensor WholeParamLayout::step_and_sync(torch::optim::Optimizer& local,
                                           torch::optim::Optimizer::LossClosure closure) {
  std::vector<bool> mask = trainable_mask(params_);
  if (mask != trainable_) {
    TORCH_WARN(
        "ZeroRedundancyOptimizer detected that the trainable parameters changed; rebuilding the "
        "parameter "
        "buckets if enabled");
    build_buckets();
  }
  if (auto* adapter = dynamic_cast<FunctionalOptimizerAdapter*>(&local)) {
    at::Tensor loss = evaluate_closure(closure);
    step_and_sync_chunked(*adapter);
    return loss;
  }
  at::Tensor loss = local.step(std::move(closure));
  Works works;
  for (int r = 0; r < world_size(); ++r) {
    std::vector<int64_t> all;
    for (const auto& g : partition_.params_per_rank[r]) all.insert(all.end(), g.begin(), g.end());
    broadcast(all, works);
  }
  wait_all(works);
  return loss;
}

std::vector<std::vector<std::vector<int64_t>>> WholeParamLayout::sync_chunks() const {
  // Chunk count from the largest shard, so every rank derives the same count and boundaries.
  const int64_t kChunkBytes = std::max<int64_t>(1, chunk_bytes_);
  constexpr int64_t kMaxChunks = 8;
  const int64_t elem = static_cast<int64_t>(params_[0].element_size());
  const int64_t largest =
      *std::max_element(partition_.numel_per_rank.begin(), partition_.numel_per_rank.end());
  const int64_t chunks =
      std::clamp<int64_t>((largest * elem + kChunkBytes - 1) / kChunkBytes, 1, kMaxChunks);
  std::vector<std::vector<std::vector<int64_t>>> out(world_size(),
                                                     std::vector<std::vector<int64_t>>(chunks));
  for (int r = 0; r < world_size(); ++r) {
    const int64_t total = partition_.numel_per_rank[r];
    int64_t before = 0;
    for (const auto& g : partition_.params_per_rank[r]) {
      for (int64_t i : g) {
        // A parameter goes to the chunk its first element falls in.
        const int64_t k = total == 0 ? 0 : std::min<int64_t>(chunks - 1, before * chunks / total);
        out[r][k].push_back(i);
        before += params_[static_cast<size_t>(i)].numel();
      }
    }
  }
  return out;
}

void WholeParamLayout::step_and_sync_chunked(FunctionalOptimizerAdapter& adapter) {
  const auto chunks = sync_chunks();
  const size_t num_chunks = chunks[0].size();
  const auto& mine = partition_.params_per_rank[rank()];
  // Where each of my parameters sits in the local optimizer: (group, index in group).
  std::vector<std::pair<size_t, size_t>> where(params_.size(), {SIZE_MAX, 0});
  for (size_t g = 0; g < mine.size(); ++g) {
    for (size_t k = 0; k < mine[g].size(); ++k) where[static_cast<size_t>(mine[g][k])] = {g, k};
  }
  Works works;
  std::vector<std::vector<at::Tensor>> grads;
  for (size_t k = 0; k < num_chunks; ++k) {
    // 1. Update this rank's chunk k.
    grads.assign(mine.size(), {});
    for (size_t g = 0; g < grads.size(); ++g) grads[g].resize(mine[g].size());
    bool any = false;
    for (int64_t i : chunks[rank()][k]) {
      const auto [g, idx] = where[static_cast<size_t>(i)];
      grads[g][idx] = params_[static_cast<size_t>(i)].grad();
      any |= grads[g][idx].defined();
    }
    if (any) {
      for (size_t g = 0; g < grads.size(); ++g) adapter.functional(g).step(grads[g]);
    }
    // 2. Start every rank's chunk k broadcast, in the same order everywhere.
    for (int r = 0; r < world_size(); ++r) broadcast(chunks[r][k], works);
  }
  wait_all(works);
}

c10::IValue WholeParamLayout::consolidation_part(const c10::IValue& local_state_dict) const {
  std::vector<int64_t> keys;
  for (const LocalEntry& e : entries_) keys.push_back(e.param);
  // Every rank lists every parameter of each group, owned or not (a manual partition may leave
  // some to no rank): the merged groups then list them all, as PyTorch's state_dict() does.
  return rekeyed_state_dict(local_state_dict, keys, all_group_params(group_counts()));
}

}  // namespace dtrain::optim::internal
