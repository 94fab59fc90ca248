// GradShardLayout: ZeRO-2's bucket-aligned ranges and sharded gradients (see layout.h).
#include <c10/core/GradMode.h>

#include <ATen/ATen.h>

#include "optim/zero/internal/layout.h"

namespace dtrain::optim::internal {

GradShardLayout::GradShardLayout(const std::vector<std::vector<at::Tensor>>& groups,
                                 comm::Group group,
                                 const std::vector<std::vector<int64_t>>& buckets,
                                 int64_t alignment)
    : ZeroLayout(groups, std::move(group)) {
  TORCH_CHECK(group_sizes_.size() == 1,
              "ZeroRedundancyOptimizer with shard_gradients supports a single parameter "
              "group, got ",
              group_sizes_.size());
  TORCH_CHECK(alignment >= 1, "flat_alignment must be at least 1 element, got ", alignment);
  const int n = world_size();
  const auto count = static_cast<int64_t>(params_.size());
  offsets_.assign(params_.size(), -1);
  partition_.world_size = n;
  partition_.params_per_rank.assign(n, std::vector<std::vector<int64_t>>(1));
  partition_.owner.assign(params_.size(), -1);
  partition_.numel_per_rank.assign(n, 0);
  int64_t offset = 0, shard = 0;
  for (const auto& bucket : buckets) {
    Segment seg;
    std::vector<int64_t> numels;
    for (int64_t i : bucket) {
      TORCH_CHECK(i >= 0 && i < count, "ZeRO-2 buckets: parameter index ", i, " out of range [0, ",
                  count, ")");
      TORCH_CHECK(offsets_[static_cast<size_t>(i)] < 0, "ZeRO-2 buckets: parameter ", i,
                  " is in two buckets");
      offsets_[static_cast<size_t>(i)] = offset + seg.numel;
      seg.numel += params_[static_cast<size_t>(i)].numel();
      numels.push_back(params_[static_cast<size_t>(i)].numel());
    }
    seg.offset = offset;
    seg.chunk = (seg.numel + n - 1) / n;
    seg.chunk = (seg.chunk + alignment - 1) / alignment * alignment;
    seg.shard_offset = shard;
    for (int r = 0; r < n; ++r) {
      const partition::Range range{std::min(seg.numel, r * seg.chunk),
                                   std::min(seg.numel, (r + 1) * seg.chunk)};
      partition_.numel_per_rank[r] += range.size();
      for (const partition::ParamSlice& s : partition::slices_in_range(numels, range)) {
        const int64_t param = bucket[static_cast<size_t>(s.param_index)];
        if (s.begin == 0) {  // a parameter belongs to the rank holding its first element
          partition_.owner[static_cast<size_t>(param)] = r;
          partition_.params_per_rank[r][0].push_back(param);
        }
        if (r != rank()) continue;
        seg.entries.push_back(entries_.size());
        entries_.push_back(LocalEntry{param, {s.begin, s.end}, 0, /*slice=*/true});
        piece_offsets_.push_back(offset + s.flat_offset);
      }
    }
    offset += seg.chunk * n;
    shard += seg.chunk;
    segments_.push_back(std::move(seg));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(offsets_[i] >= 0, "ZeRO-2 buckets: parameter ", i,
                " is in no bucket; DDP must reduce every "
                "parameter of the optimizer");
  }
  // Every parameter becomes a view of its bucket's segment; padding stays zero.
  param_buffer_ = at::zeros({std::max<int64_t>(offset, 1)}, params_[0].options());
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    at::Tensor view = param_buffer_.narrow(0, offsets_[i], p.numel()).view(p.sizes());
    view.copy_(p.detach());
    p.set_data(view);
  }
  grad_shard_ = at::zeros({shard}, params_[0].options());
  for (const Segment& seg : segments_) {
    for (size_t k : seg.entries) {
      const int64_t size = entries_[k].range.size();
      piece_tensors_.push_back(param_buffer_.narrow(0, piece_offsets_[k], size));
      const int64_t in_chunk = piece_offsets_[k] - seg.offset - rank() * seg.chunk;
      piece_grads_.push_back(grad_shard_.narrow(0, seg.shard_offset + in_chunk, size));
    }
  }
}

std::vector<at::Tensor> GradShardLayout::local_tensors(size_t group) const {
  (void)group;
  return piece_tensors_;
}

at::Tensor GradShardLayout::grad_chunk(size_t b) const {
  const Segment& seg = segments_.at(b);
  return grad_shard_.narrow(0, seg.shard_offset, seg.chunk);
}

std::vector<at::Tensor> GradShardLayout::gradients() const {
  if (!reduced_) return {};
  return piece_grads_;
}

at::Tensor GradShardLayout::step_and_sync(torch::optim::Optimizer& local,
                                          torch::optim::Optimizer::LossClosure closure) {
  at::Tensor loss = evaluate_closure(closure);
  auto* adapter = dynamic_cast<FunctionalOptimizerAdapter*>(&local);
  TORCH_CHECK(adapter != nullptr,
              "ZeroRedundancyOptimizer with shard_gradients needs a functional local optimizer");
  c10::NoGradGuard no_grad;
  comm::C10dGroup& pg = *group_.pg();
  Works works;
  std::vector<at::Tensor> grads(entries_.size());
  for (const Segment& seg : segments_) {
    // This bucket's pieces, while the previous buckets' all-gathers are on the wire.
    if (reduced_ && !seg.entries.empty()) {
      std::fill(grads.begin(), grads.end(), at::Tensor());
      for (size_t k : seg.entries) grads[k] = piece_grads_[k];
      adapter->functional(0).step(grads);
    }
    if (seg.chunk == 0) continue;
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < world_size(); ++r) {
      outputs[0].push_back(
          wire_view(param_buffer_.narrow(0, seg.offset + r * seg.chunk, seg.chunk)));
    }
    std::vector<at::Tensor> input = {outputs[0][static_cast<size_t>(rank())]};
    works.push_back(pg.allgather(outputs, input));
  }
  wait_all(works);
  return loss;
}

void GradShardLayout::check_can_add_group() const {
  TORCH_CHECK(
      false,
      "add_param_group is not supported with shard_gradients (ZeRO-2): its ranges follow DDP's "
      "buckets, which cover every parameter DDP reduces; create the optimizer over DDP's "
      "parameters");
}

c10::IValue GradShardLayout::consolidation_part(const c10::IValue& local_state_dict) const {
  return rekeyed_state_dict(local_state_dict, piece_offsets_, all_group_params(group_counts()));
}

c10::IValue GradShardLayout::assemble_consolidated(const c10::IValue& merged) const {
  return assemble_pieces(merged, offsets_, params_);
}

}  // namespace dtrain::optim::internal
