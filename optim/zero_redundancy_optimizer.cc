#include "optim/zero_redundancy_optimizer.h"

#include <algorithm>
#include <climits>
#include <iostream>
#include <map>
#include <random>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/consolidation.h"
#include "comm/object_collectives.h"
#include "optim/torch_state.h"

namespace dtrain::optim {
namespace {

std::string type_name(const at::Tensor& t) {
  if (t.is_sparse()) return "sparse " + std::string(c10::toString(t.scalar_type())) + " tensor";
  return absl::StrCat(c10::toString(t.scalar_type()), " ", t.device().str(), " tensor");
}

// PyTorch-format state of any local optimizer (local parameter indices).
c10::IValue local_state_dict(torch::optim::Optimizer& local) {
  if (auto* adapter = dynamic_cast<FunctionalOptimizerAdapter*>(&local)) return adapter->state_dict();
  return torch_optim_state_dict(local);
}

void load_local_state_dict(torch::optim::Optimizer& local, const c10::IValue& sd) {
  if (auto* adapter = dynamic_cast<FunctionalOptimizerAdapter*>(&local)) {
    adapter->load_state_dict(sd);
  } else {
    load_torch_optim_state_dict(local, sd);
  }
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                                                 LocalOptimizer local, ZeroOptions options)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              local.defaults ? local.defaults->clone() : nullptr),
      local_factory_(std::move(local)),
      options_(std::move(options)) {
  init(std::move(param_groups));
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params, LocalOptimizer local,
                                                 ZeroOptions options)
    : ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup>{
                                  torch::optim::OptimizerParamGroup(std::move(params))},
                              std::move(local), std::move(options)) {}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::init(std::vector<torch::optim::OptimizerParamGroup> param_groups) {
  TORCH_CHECK(local_factory_.make != nullptr && defaults_ != nullptr,
              "ZeroRedundancyOptimizer needs a local optimizer: pass local_optimizer<torch::optim::Adam>(options) "
              "or local_optimizer<FunctionalOptimizerAdapter>(name, options)");
  TORCH_CHECK(options_.group.is_member(),
              "ZeroRedundancyOptimizer: ZeroOptions::group is not set or this rank is not a member of it");
  size_t total = 0;
  for (const auto& g : param_groups) total += g.params().size();
  TORCH_CHECK(total > 0, "ZeroRedundancyOptimizer got an empty parameter list");
  for (const auto& g : param_groups) torch::optim::Optimizer::add_param_group(g);
  validate_params();
  if (!options_.params_per_rank.empty()) {
    TORCH_CHECK(!flat(), "`params_per_rank` is a manual whole-parameter partition: use it with the sorted_greedy "
                "strategy, not kFlat");
    TORCH_CHECK(param_groups_.size() == 1, "Specifying `params_per_rank` only supports a single parameter group");
  }
  if (options_.overlap_with_ddp) {
    TORCH_CHECK(!flat(), "overlap_with_ddp partitions whole parameters by DDP bucket: use the sorted_greedy strategy, "
                "not kFlat");
    TORCH_CHECK(param_groups_.size() == 1, "overlap_with_ddp supports a single parameter group, got ",
                param_groups_.size());
  }
  TORCH_CHECK(options_.flat_alignment >= 1, "flat_alignment must be at least 1 element, got ", options_.flat_alignment);
  // One name per instance for control-plane keys (rank 0's), and a check that every rank built
  // the same optimizer: mismatched settings would otherwise pair unrelated collectives.
  std::string fingerprint = absl::StrCat("strategy=", static_cast<int>(options_.strategy), " alignment=",
                                         options_.flat_alignment, " bucket_view=", options_.parameters_as_bucket_view,
                                         " overlap=", options_.overlap_with_ddp, " groups=",
                                         param_groups_.size(), " params_per_rank=", options_.params_per_rank.size(),
                                         " sizes=");
  for (const auto& g : param_groups_) {
    for (const auto& p : g.params()) absl::StrAppend(&fingerprint, p.numel(), ",");
    absl::StrAppend(&fingerprint, ";");
  }
  c10::impl::GenericList mine(c10::AnyType::get());
  mine.push_back(absl::StrFormat("zero/%08x%08x", std::random_device{}(), std::random_device{}()));
  mine.push_back(fingerprint);
  auto all = comm::all_gather_object(options_.group, mine);
  TORCH_CHECK(all.ok(), "ZeroRedundancyOptimizer construction is a collective: ", all.status().ToString());
  for (int r = 0; r < world_size(); ++r) {
    const std::string theirs = (*all)[r].toList().get(1).toStringRef();
    TORCH_CHECK(theirs == fingerprint, "ZeroRedundancyOptimizer was built differently on rank ", r, " (", theirs,
                ") and rank ", rank(), " (", fingerprint, "); every rank must pass the same parameters and options");
  }
  const c10::IValue id = (*all)[0].toList().get(0);
  store_prefix_ = id.toStringRef();
  partition_parameters();
  if (flat()) build_flat_layout();
  build_local_optimizer();
  TORCH_CHECK(!options_.overlap_with_ddp || dynamic_cast<FunctionalOptimizerAdapter*>(local_.get()) != nullptr,
              "overlap_with_ddp steps parameters bucket by bucket, which needs a functional local optimizer: pass "
              "local_optimizer<FunctionalOptimizerAdapter>(name, options) instead of a torch::optim type");
  trainable_ = trainable_mask();
  build_buckets();
}

void ZeroRedundancyOptimizer::set_overlap_partition(std::vector<std::vector<int64_t>> params_per_rank) {
  TORCH_CHECK(options_.overlap_with_ddp, "set_overlap_partition is for overlap_with_ddp: set "
              "ZeroOptions::overlap_with_ddp = true");
  TORCH_CHECK(!stepped_ && local_state_bytes() == 0, "the ZeRO overlap hook must be registered before the first "
              "step: the optimizer already holds state for the old partition");
  options_.params_per_rank = std::move(params_per_rank);
  partition_parameters();
  global_to_local_.clear();
  build_local_optimizer();
  trainable_ = trainable_mask();
  build_buckets();
  consolidated_ = c10::IValue();
}

void ZeroRedundancyOptimizer::overlap_step(const std::vector<int64_t>& params, const std::vector<at::Tensor>& grads) {
  TORCH_CHECK(params.size() == grads.size(), "overlap_step: ", params.size(), " parameters but ", grads.size(),
              " gradients");
  auto& adapter = dynamic_cast<FunctionalOptimizerAdapter&>(*local_);
  std::vector<at::Tensor> local_grads;
  bool any = false;
  for (size_t k = 0; k < params.size(); ++k) {
    const int64_t i = params[k];
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(all_params_.size()), "overlap_step: parameter index ", i,
                " out of range");
    if (partition_.owner[i] != rank()) continue;
    if (local_grads.empty()) {
      local_grads.resize(local_to_global_.size());
      if (global_to_local_.empty()) {
        global_to_local_.assign(all_params_.size(), -1);
        for (size_t l = 0; l < local_to_global_.size(); ++l) global_to_local_[local_to_global_[l]] = static_cast<int64_t>(l);
      }
    }
    local_grads[static_cast<size_t>(global_to_local_[i])] = grads[k];
    any = true;
  }
  if (!any) return;
  sync_options(/*to_local=*/true);
  c10::NoGradGuard no_grad;
  adapter.functional(0).step(local_grads);
  stepped_ = true;
  consolidated_ = c10::IValue();
}

std::vector<c10::intrusive_ptr<c10d::Work>> ZeroRedundancyOptimizer::overlap_broadcast(
    const std::vector<int64_t>& params) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  comm::C10dGroup& pg = *options_.group.pg();
  // Runs of consecutive parameters with one owner go out as one tensor when they sit next to
  // each other in the owner's bucket (bucket views), else one broadcast per parameter.
  const std::vector<int64_t>& offset = bucket_offset_;
  c10::NoGradGuard no_grad;
  size_t k = 0;
  while (k < params.size()) {
    const int owner = partition_.owner.at(params[k]);
    c10d::BroadcastOptions bo;
    bo.rootRank = owner;
    if (owner < 0) {
      ++k;
      continue;
    }
    if (offset[params[k]] >= 0) {
      size_t end = k + 1;
      int64_t hi = offset[params[k]] + all_params_[params[k]].numel();
      while (end < params.size() && partition_.owner.at(params[end]) == owner && offset[params[end]] == hi) {
        hi += all_params_[params[end]].numel();
        ++end;
      }
      std::vector<at::Tensor> t = {buckets_[owner].narrow(0, offset[params[k]], hi - offset[params[k]])};
      works.push_back(pg.broadcast(t, bo));
      k = end;
      continue;
    }
    std::vector<at::Tensor> t = {all_params_[params[k]].detach()};
    works.push_back(pg.broadcast(t, bo));
    ++k;
  }
  return works;
}

void ZeroRedundancyOptimizer::validate_params() const {
  const at::Tensor* first = nullptr;
  for (const auto& g : param_groups_) {
    for (const auto& p : g.params()) {
      TORCH_CHECK(p.defined(), "ZeroRedundancyOptimizer got an undefined parameter");
      if (first == nullptr) {
        TORCH_CHECK(!p.is_sparse(), "ZeroRedundancyOptimizer only supports using the same dense type for all "
                    "parameters but got ", type_name(p));
        first = &p;
        continue;
      }
      TORCH_CHECK(!p.is_sparse() && p.scalar_type() == first->scalar_type() && p.device() == first->device(),
                  "ZeroRedundancyOptimizer only supports using the same dense type for all parameters but got both ",
                  type_name(*first), " and ", type_name(p));
    }
  }
}

void ZeroRedundancyOptimizer::partition_parameters() {
  all_params_.clear();
  group_sizes_.clear();
  for (const auto& g : param_groups_) {
    group_sizes_.emplace_back();
    for (const auto& p : g.params()) {
      all_params_.push_back(p);
      group_sizes_.back().push_back(p.numel());
    }
  }
  if (flat()) {
    std::vector<int64_t> numels;
    for (const auto& g : group_sizes_) numels.insert(numels.end(), g.begin(), g.end());
    absl::StatusOr<partition::FlatPartition> fp = partition::flat_partition(numels, world_size(), options_.flat_alignment);
    TORCH_CHECK(fp.ok(), "ZeroRedundancyOptimizer: ", fp.status().message());
    flat_ranges_ = fp->ranges;
    // The whole-parameter view, for introspection: a parameter belongs to the rank holding its
    // first element.
    partition_ = partition::ParamPartition();
    partition_.world_size = world_size();
    partition_.params_per_rank.assign(world_size(), std::vector<std::vector<int64_t>>(group_sizes_.size()));
    partition_.owner.assign(numels.size(), -1);
    partition_.numel_per_rank.assign(world_size(), 0);
    for (int r = 0; r < world_size(); ++r) partition_.numel_per_rank[r] = flat_ranges_[r].size();
    int64_t index = 0, offset = 0;
    for (size_t g = 0; g < group_sizes_.size(); ++g) {
      for (int64_t n : group_sizes_[g]) {
        int r = 0;
        while (r + 1 < world_size() && flat_ranges_[r].end <= offset) ++r;
        partition_.owner[index] = r;
        partition_.params_per_rank[r][g].push_back(index);
        offset += n;
        ++index;
      }
    }
    pieces_.clear();
    std::vector<size_t> group_of;
    for (size_t g = 0; g < group_sizes_.size(); ++g) group_of.insert(group_of.end(), group_sizes_[g].size(), g);
    for (const auto& s : fp->slices[rank()]) {
      pieces_.push_back(Piece{s.param_index, s.begin, s.end, s.flat_offset, group_of[s.param_index]});
    }
    std::stable_sort(pieces_.begin(), pieces_.end(), [](const Piece& a, const Piece& b) { return a.group < b.group; });
    return;
  }
  absl::StatusOr<partition::ParamPartition> p =
      options_.params_per_rank.empty()
          ? partition::sorted_greedy_partition(group_sizes_, world_size())
          : partition::manual_partition(group_sizes_, options_.params_per_rank, world_size());
  TORCH_CHECK(p.ok(), "ZeroRedundancyOptimizer: ", p.status().message());
  partition_ = *std::move(p);
  local_to_global_.clear();
  for (const auto& g : partition_.params_per_rank[rank()]) {
    local_to_global_.insert(local_to_global_.end(), g.begin(), g.end());
  }
}

void ZeroRedundancyOptimizer::build_flat_layout() {
  int64_t total = 0;
  flat_offsets_.clear();
  for (const auto& p : all_params_) {
    flat_offsets_.push_back(total);
    total += p.numel();
  }
  flat_buffer_ = at::empty({std::max<int64_t>(total, 1)}, all_params_[0].options());
  for (size_t i = 0; i < all_params_.size(); ++i) {
    at::Tensor& p = all_params_[i];
    at::Tensor view = flat_buffer_.narrow(0, flat_offsets_[i], p.numel()).view(p.sizes());
    view.copy_(p.detach());
    p.set_data(view);
  }
  piece_tensors_.clear();
  for (const Piece& piece : pieces_) {
    piece_tensors_.push_back(flat_buffer_.narrow(0, piece.flat_offset, piece.end - piece.begin));
  }
}

void ZeroRedundancyOptimizer::build_local_optimizer() {
  std::vector<torch::optim::OptimizerParamGroup> local_groups;
  if (flat()) {
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      std::vector<at::Tensor> tensors;
      for (size_t k = 0; k < pieces_.size(); ++k) {
        if (pieces_[k].group == g) tensors.push_back(piece_tensors_[k]);
      }
      local_groups.emplace_back(tensors, param_groups_[g].options().clone());
    }
    local_ = local_factory_.make(std::move(local_groups));
    return;
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    std::vector<at::Tensor> params;
    for (int64_t i : partition_.params_per_rank[rank()][g]) params.push_back(all_params_[i]);
    local_groups.emplace_back(params, param_groups_[g].options().clone());
  }
  local_ = local_factory_.make(std::move(local_groups));
}

std::vector<bool> ZeroRedundancyOptimizer::trainable_mask() const {
  std::vector<bool> mask;
  for (const auto& p : all_params_) mask.push_back(p.requires_grad());
  return mask;
}

void ZeroRedundancyOptimizer::build_buckets() {
  bucket_offset_.assign(all_params_.size(), -1);
  if (!options_.parameters_as_bucket_view || flat()) return;
  buckets_.assign(world_size(), at::Tensor());
  for (int r = 0; r < world_size(); ++r) {
    int64_t size = 0;
    std::vector<int64_t> members;
    for (const auto& g : partition_.params_per_rank[r]) {
      for (int64_t i : g) {
        at::Tensor& p = all_params_[i];
        if (!p.requires_grad()) {
          // Leave the bucket: its own storage, so rebuilding does not destroy its values.
          p.set_data(p.detach().clone());
          continue;
        }
        members.push_back(i);
        size += p.numel();
      }
    }
    const at::TensorOptions opts = all_params_[0].options();
    at::Tensor bucket = at::empty({std::max<int64_t>(size, 1)}, opts);
    int64_t offset = 0;
    for (int64_t i : members) {
      at::Tensor& p = all_params_[i];
      at::Tensor view = bucket.narrow(0, offset, p.numel()).view(p.sizes());
      view.copy_(p.detach());
      p.set_data(view);
      bucket_offset_[i] = offset;
      offset += p.numel();
    }
    buckets_[r] = bucket;
  }
}

void ZeroRedundancyOptimizer::sync_options(bool to_local) {
  auto& local_groups = local_->param_groups();
  TORCH_CHECK(local_groups.size() == param_groups_.size(), "ZeroRedundancyOptimizer: the local optimizer has ",
              local_groups.size(), " groups, the wrapper ", param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    if (to_local) {
      local_groups[g].set_options(param_groups_[g].options().clone());
    } else {
      param_groups_[g].set_options(local_groups[g].options().clone());
    }
  }
}

void ZeroRedundancyOptimizer::check_add_param_group_agreement(bool calling) {
  c10d::Store& store = *options_.group.store();
  const std::string key = absl::StrCat(store_prefix_, "/add_param_group/", add_param_group_calls_);
  const std::string how = absl::StrCat("add_param_group must be called on all ranks: ");
  if (!calling) {
    // After a failed step: has another rank started an add_param_group this rank never made?
    // (A store that fails too leaves the step's own error to propagate.)
    bool other_called = false;
    try {
      other_called = store.check({key});
    } catch (const std::exception&) {
    }
    TORCH_CHECK(!other_called, how, "another rank called it (call #", add_param_group_calls_ + 1,
                ") but rank ", rank(), " went on to step()");
    return;
  }
  const int64_t arrived = store.add(key, 1);
  if (arrived == world_size()) store.set(key + "/all", std::vector<uint8_t>{1});
  try {
    store.wait({key + "/all"}, options_.group.timeout());
  } catch (const std::exception&) {
    const int64_t now = store.add(key, 0);
    TORCH_CHECK(false, how, "only ", now, " of ", world_size(), " ranks called it (call #", add_param_group_calls_ + 1,
                ") within the group timeout of ", options_.group.timeout().count(), " ms");
  }
  ++add_param_group_calls_;
}

void ZeroRedundancyOptimizer::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  // Every rank has the same strategy (checked at construction), so all fail alike here.
  TORCH_CHECK(!flat(), "add_param_group is not supported with PartitionStrategy::kFlat yet (the flat buffer and "
              "every rank's range would move); create the optimizer with all groups, or use kSortedGreedy");
  check_add_param_group_agreement(/*calling=*/true);
  TORCH_CHECK(!options_.overlap_with_ddp, "add_param_group: overlap_with_ddp supports a single parameter group, "
              "created with the optimizer");
  TORCH_CHECK(options_.params_per_rank.empty(),
              "add_param_group: this ZeroRedundancyOptimizer uses a manual params_per_rank, which supports a single "
              "parameter group");
  torch::optim::Optimizer::add_param_group(param_group);
  validate_params();
  // Sorted-greedy is deterministic and carries loads group to group: earlier groups keep their
  // owners, only the new group's parameters are placed.
  partition_parameters();
  std::vector<at::Tensor> mine;
  for (int64_t i : partition_.params_per_rank[rank()].back()) mine.push_back(all_params_[i]);
  local_->add_param_group(torch::optim::OptimizerParamGroup(mine, param_groups_.back().options().clone()));
  trainable_ = trainable_mask();
  build_buckets();
  consolidated_ = c10::IValue();
}

void ZeroRedundancyOptimizer::sync_params() {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  comm::C10dGroup& pg = *options_.group.pg();
  for (int r = 0; r < world_size(); ++r) {
    c10d::BroadcastOptions bo;
    bo.rootRank = r;
    if (flat()) {
      if (flat_ranges_[r].size() == 0) continue;
      std::vector<at::Tensor> t = {flat_buffer_.narrow(0, flat_ranges_[r].begin, flat_ranges_[r].size())};
      works.push_back(pg.broadcast(t, bo));
      continue;
    }
    if (options_.parameters_as_bucket_view) {
      std::vector<at::Tensor> t = {buckets_[r]};
      works.push_back(pg.broadcast(t, bo));
      continue;
    }
    for (const auto& g : partition_.params_per_rank[r]) {
      for (int64_t i : g) {
        std::vector<at::Tensor> t = {all_params_[i].detach()};
        works.push_back(pg.broadcast(t, bo));
      }
    }
  }
  for (auto& w : works) w->wait();
}

at::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  // Inside a Join context: tell it this rank still has inputs (no-op otherwise).
  if (!in_join_hook_) comm::Join::notify_join_context(*this);
  // No store traffic on the hot path: only a step that fails asks the store whether the cause is
  // another rank's add_param_group (then that is the error), else the failure propagates as is.
  try {
    return step_unchecked(std::move(closure));
  } catch (const std::exception&) {
    check_add_param_group_agreement(/*calling=*/false);
    throw;
  }
}

at::Tensor ZeroRedundancyOptimizer::step_unchecked(LossClosure closure) {
  if (options_.overlap_with_ddp) {
    // The DDP hook already stepped and synchronised every parameter during backward.
    at::Tensor loss;
    if (closure) {
      c10::AutoGradMode enable(true);
      loss = closure();
    }
    return loss;
  }
  stepped_ = true;
  if (flat()) {
    sync_options(/*to_local=*/true);
    at::Tensor loss;
    if (closure) {
      c10::AutoGradMode enable(true);
      loss = closure();
    }
    // Each piece's gradient is the matching slice of its parameter's gradient (a view when the
    // gradient is contiguous); frozen or unused parameters leave their pieces without one.
    for (size_t k = 0; k < pieces_.size(); ++k) {
      const at::Tensor& grad = all_params_[pieces_[k].param].grad();
      piece_tensors_[k].mutable_grad() =
          grad.defined() ? grad.reshape(-1).narrow(0, pieces_[k].begin, pieces_[k].end - pieces_[k].begin) : at::Tensor();
    }
    local_->step();
    sync_options(/*to_local=*/false);
    c10::NoGradGuard no_grad;
    sync_params();
    consolidated_ = c10::IValue();
    return loss;
  }
  std::vector<bool> mask = trainable_mask();
  if (mask != trainable_) {
    TORCH_WARN("ZeroRedundancyOptimizer detected that the trainable parameters changed; rebuilding the parameter "
               "buckets if enabled");
    trainable_ = std::move(mask);
    build_buckets();
  }
  sync_options(/*to_local=*/true);
  at::Tensor loss;
  if (auto* adapter = dynamic_cast<FunctionalOptimizerAdapter*>(local_.get())) {
    if (closure) {
      c10::AutoGradMode enable(true);
      loss = closure();
    }
    step_and_sync_overlapped(*adapter);
    sync_options(/*to_local=*/false);
  } else {
    loss = local_->step(std::move(closure));
    sync_options(/*to_local=*/false);
    c10::NoGradGuard no_grad;
    sync_params();
  }
  consolidated_ = c10::IValue();
  return loss;
}

std::vector<std::vector<std::vector<int64_t>>> ZeroRedundancyOptimizer::sync_chunks() const {
  // Chunk count from the largest shard, so every rank derives the same count and boundaries.
  const int64_t kChunkBytes = std::max<int64_t>(1, options_.overlap_chunk_bytes);
  constexpr int64_t kMaxChunks = 8;
  const int64_t elem = static_cast<int64_t>(all_params_[0].element_size());
  const int64_t largest = *std::max_element(partition_.numel_per_rank.begin(), partition_.numel_per_rank.end());
  const int64_t chunks = std::clamp<int64_t>((largest * elem + kChunkBytes - 1) / kChunkBytes, 1, kMaxChunks);
  std::vector<std::vector<std::vector<int64_t>>> out(world_size(), std::vector<std::vector<int64_t>>(chunks));
  for (int r = 0; r < world_size(); ++r) {
    const int64_t total = partition_.numel_per_rank[r];
    int64_t before = 0;
    for (const auto& g : partition_.params_per_rank[r]) {
      for (int64_t i : g) {
        // A parameter goes to the chunk its first element falls in.
        const int64_t k = total == 0 ? 0 : std::min<int64_t>(chunks - 1, before * chunks / total);
        out[r][k].push_back(i);
        before += all_params_[i].numel();
      }
    }
  }
  return out;
}

void ZeroRedundancyOptimizer::step_and_sync_overlapped(FunctionalOptimizerAdapter& adapter) {
  const auto chunks = sync_chunks();
  const size_t num_chunks = chunks[0].size();
  // Where each of my parameters sits in the local optimizer: (group, index in group).
  std::vector<std::pair<size_t, size_t>> where(all_params_.size(), {SIZE_MAX, 0});
  for (size_t g = 0; g < partition_.params_per_rank[rank()].size(); ++g) {
    const auto& ids = partition_.params_per_rank[rank()][g];
    for (size_t k = 0; k < ids.size(); ++k) where[ids[k]] = {g, k};
  }
  const std::vector<int64_t>& offset = bucket_offset_;
  comm::C10dGroup& pg = *options_.group.pg();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<std::vector<at::Tensor>> grads;
  for (size_t k = 0; k < num_chunks; ++k) {
    // 1. Update this rank's chunk k.
    grads.assign(partition_.params_per_rank[rank()].size(), {});
    for (size_t g = 0; g < grads.size(); ++g) grads[g].resize(partition_.params_per_rank[rank()][g].size());
    bool any = false;
    for (int64_t i : chunks[rank()][k]) {
      const auto [g, idx] = where[i];
      grads[g][idx] = all_params_[i].grad();
      any |= grads[g][idx].defined();
    }
    if (any) {
      for (size_t g = 0; g < grads.size(); ++g) adapter.functional(g).step(grads[g]);
    }
    // 2. Start every rank's chunk k broadcast, in the same order everywhere.
    c10::NoGradGuard no_grad;
    for (int r = 0; r < world_size(); ++r) {
      c10d::BroadcastOptions bo;
      bo.rootRank = r;
      if (options_.parameters_as_bucket_view) {
        int64_t lo = -1, hi = -1;
        for (int64_t i : chunks[r][k]) {
          if (offset[i] < 0) continue;
          if (lo < 0) lo = offset[i];
          hi = offset[i] + all_params_[i].numel();
        }
        // Frozen parameters are outside the buckets and never change: nothing to send for them.
        if (lo >= 0) {
          std::vector<at::Tensor> t = {buckets_[r].narrow(0, lo, hi - lo)};
          works.push_back(pg.broadcast(t, bo));
        }
      } else {
        for (int64_t i : chunks[r][k]) {
          std::vector<at::Tensor> t = {all_params_[i].detach()};
          works.push_back(pg.broadcast(t, bo));
        }
      }
    }
  }
  for (auto& w : works) w->wait();
}

c10::IValue ZeroRedundancyOptimizer::local_state_global_indices() {
  sync_options(/*to_local=*/true);
  auto sd = local_state_dict(*local_).toGenericDict();
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  for (const auto& kv : sd.at("state").toGenericDict()) {
    state.insert(local_to_global_.at(static_cast<size_t>(kv.key().toInt())), kv.value());
  }
  c10::impl::GenericList groups(c10::AnyType::get());
  const auto local_groups = sd.at("param_groups").toList();
  for (size_t g = 0; g < local_groups.size(); ++g) {
    auto group = local_groups.get(g).toGenericDict().copy();
    group.insert_or_assign("params", c10::List<int64_t>(partition_.params_per_rank[rank()][g]));
    groups.push_back(group);
  }
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("state", state);
  out.insert("param_groups", groups);
  return out;
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  absl::StatusOr<c10::IValue> full = checkpoint::consolidate_state_dict(
      options_.group, flat() ? flat_local_state_pieces() : local_state_global_indices(), to);
  TORCH_CHECK(full.ok(), "consolidate_state_dict: ", full.status().ToString());
  consolidated_ = flat() && !full->isNone() ? assemble_flat_state(*full) : *full;
}

c10::IValue ZeroRedundancyOptimizer::flat_local_state_pieces() {
  // Pieces are keyed by their flat offset (unique across ranks); the groups carry global indices.
  sync_options(/*to_local=*/true);
  auto sd = local_state_dict(*local_).toGenericDict();
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  for (const auto& kv : sd.at("state").toGenericDict()) {
    state.insert(pieces_.at(static_cast<size_t>(kv.key().toInt())).flat_offset, kv.value());
  }
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("state", state);
  out.insert("param_groups", global_param_groups(sd.at("param_groups")));
  return out;
}

c10::IValue ZeroRedundancyOptimizer::assemble_flat_state(const c10::IValue& pieces) const {
  auto in = pieces.toGenericDict();
  // Flat offset -> parameter, then each parameter's pieces concatenated in offset order.
  std::map<int64_t, std::vector<std::pair<int64_t, c10::impl::GenericDict>>> by_param;
  for (const auto& kv : in.at("state").toGenericDict()) {
    const int64_t offset = kv.key().toInt();
    const int64_t param =
        static_cast<int64_t>(std::upper_bound(flat_offsets_.begin(), flat_offsets_.end(), offset) - flat_offsets_.begin()) - 1;
    by_param[param].emplace_back(offset, kv.value().toGenericDict());
  }
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  for (auto& [param, list] : by_param) {
    std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    for (const auto& kv : list.front().second) {
      const c10::IValue& v = kv.value();
      if (!v.isTensor() || v.toTensor().dim() == 0) {
        entry.insert(kv.key(), v);
        continue;
      }
      std::vector<at::Tensor> parts;
      for (const auto& piece : list) parts.push_back(piece.second.at(kv.key()).toTensor().reshape(-1));
      entry.insert(kv.key(), at::cat(parts).view(all_params_[param].sizes()));
    }
    state.insert(param, entry);
  }
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("state", state);
  out.insert("param_groups", in.at("param_groups"));
  return out;
}

c10::IValue ZeroRedundancyOptimizer::state_dict() const {
  TORCH_CHECK(!consolidated_.isNone(),
              "Optimizer state has not been consolidated on this rank. Please call `consolidate_state_dict(to=",
              rank(), ")` on all ranks beforehand if you meant to save the global state.");
  return consolidated_;
}

void ZeroRedundancyOptimizer::load_state_dict(const c10::IValue& state_dict) {
  TORCH_CHECK(state_dict.isGenericDict(), "load_state_dict: expected a dict");
  auto sd = state_dict.toGenericDict();
  auto groups = sd.at("param_groups").toList();
  auto state = sd.at("state").toGenericDict();
  // The global format does not depend on the partition: pick this rank's parameters by index
  // (kFlat: the slices of them this rank holds).
  c10::impl::GenericDict local_state(c10::IntType::get(), c10::AnyType::get());
  for (size_t k = 0; k < local_entry_count(); ++k) {
    auto [param, range] = local_entry(k);
    const c10::IValue key(param);
    if (!state.contains(key)) continue;
    if (!flat()) {
      local_state.insert(static_cast<int64_t>(k), state.at(key));
      continue;
    }
    c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    for (const auto& kv : state.at(key).toGenericDict()) {
      const c10::IValue& v = kv.value();
      if (v.isTensor() && v.toTensor().dim() > 0) {
        // The same check (and words) as the functional optimizers' load: a state tensor of another
        // shape would be cut into this rank's slice and scramble the state.
        const at::Tensor& p = all_params_[static_cast<size_t>(param)];
        TORCH_CHECK(v.toTensor().sizes() == p.sizes(), "load_state_dict: state '", kv.key().toStringRef(),
                    "' of parameter ", param, " has shape ", v.toTensor().sizes(), ", the parameter has shape ",
                    p.sizes());
        entry.insert(kv.key(), v.toTensor().reshape(-1).narrow(0, range.begin, range.size()).clone());
      } else {
        entry.insert(kv.key(), v);
      }
    }
    local_state.insert(static_cast<int64_t>(k), entry);
  }
  load_local_state(groups, local_state);
}

void ZeroRedundancyOptimizer::load_local_state(const c10::impl::GenericList& groups,
                                               c10::impl::GenericDict local_state) {
  TORCH_CHECK(groups.size() == param_groups_.size(), "load_state_dict: the state dict has ", groups.size(),
              " parameter groups, this optimizer has ", param_groups_.size());
  c10::impl::GenericList local_groups(c10::AnyType::get());
  int64_t next = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto group = groups.get(g).toGenericDict().copy();
    TORCH_CHECK(group.at("params").toList().size() == param_groups_[g].params().size(), "load_state_dict: group ", g,
                " has ", group.at("params").toList().size(), " parameters in the state dict and ",
                param_groups_[g].params().size(), " here");
    std::vector<int64_t> local_indices;
    const size_t count = flat() ? static_cast<size_t>(std::count_if(pieces_.begin(), pieces_.end(),
                                                                    [g](const Piece& p) { return p.group == g; }))
                                : partition_.params_per_rank[rank()][g].size();
    for (size_t k = 0; k < count; ++k) local_indices.push_back(next++);
    group.insert_or_assign("params", c10::List<int64_t>(local_indices));
    local_groups.push_back(group);
  }
  c10::impl::GenericDict local_sd(c10::StringType::get(), c10::AnyType::get());
  local_sd.insert("state", std::move(local_state));
  local_sd.insert("param_groups", local_groups);
  load_local_state_dict(*local_, local_sd);
  sync_options(/*to_local=*/false);
  consolidated_ = c10::IValue();
}

size_t ZeroRedundancyOptimizer::local_entry_count() const {
  return flat() ? pieces_.size() : local_to_global_.size();
}

std::pair<int64_t, checkpoint::ElementRange> ZeroRedundancyOptimizer::local_entry(size_t k) const {
  if (flat()) {
    const Piece& piece = pieces_.at(k);
    return {piece.param, {piece.begin, piece.end}};
  }
  const int64_t param = local_to_global_.at(k);
  return {param, {0, all_params_[static_cast<size_t>(param)].numel()}};
}

c10::impl::GenericList ZeroRedundancyOptimizer::global_param_groups(const c10::IValue& local_groups) const {
  // Every group lists all of its parameters by global index, as the unsharded optimizer would.
  c10::impl::GenericList groups(c10::AnyType::get());
  const auto local = local_groups.toList();
  int64_t first = 0;
  for (size_t g = 0; g < local.size(); ++g) {
    auto group = local.get(g).toGenericDict().copy();
    std::vector<int64_t> indices(param_groups_[g].params().size());
    for (size_t i = 0; i < indices.size(); ++i) indices[i] = first + static_cast<int64_t>(i);
    first += static_cast<int64_t>(indices.size());
    group.insert_or_assign("params", c10::List<int64_t>(indices));
    groups.push_back(group);
  }
  return groups;
}

std::map<int64_t, checkpoint::ElementRange> ZeroRedundancyOptimizer::owned_ranges() const {
  std::map<int64_t, checkpoint::ElementRange> out;
  for (size_t k = 0; k < local_entry_count(); ++k) {
    auto [param, range] = local_entry(k);
    if (range.size() > 0) out[param] = range;
  }
  return out;
}

checkpoint::ShardedState ZeroRedundancyOptimizer::sharded_state() {
  sync_options(/*to_local=*/true);
  auto sd = local_state_dict(*local_).toGenericDict();
  checkpoint::ShardedState out;
  for (const auto& kv : sd.at("state").toGenericDict()) {
    auto [param, range] = local_entry(static_cast<size_t>(kv.key().toInt()));
    const at::Tensor& p = all_params_[static_cast<size_t>(param)];
    checkpoint::ShardedState::Param entry;
    entry.shape = p.sizes().vec();
    entry.range = range;
    const bool whole = range.begin == 0 && range.end == p.numel();
    for (const auto& e : kv.value().toGenericDict()) {
      const c10::IValue& v = e.value();
      // The sharded format: a whole parameter's state is full-shaped, a slice's is 1-D.
      if (v.isTensor() && v.toTensor().dim() > 0) {
        entry.entries.insert(e.key(), whole ? v.toTensor().reshape(p.sizes()) : v.toTensor().reshape(-1));
      } else {
        entry.entries.insert(e.key(), v);
      }
    }
    out.params[param] = std::move(entry);
  }
  out.param_groups = global_param_groups(sd.at("param_groups"));
  return out;
}

void ZeroRedundancyOptimizer::load_sharded_state(const checkpoint::ShardedState& state) {
  TORCH_CHECK(state.param_groups.isList(), "load_sharded_state: the state has no param_groups list");
  c10::impl::GenericDict local_state(c10::IntType::get(), c10::AnyType::get());
  for (size_t k = 0; k < local_entry_count(); ++k) {
    auto [param, range] = local_entry(k);
    auto it = state.params.find(param);
    if (it == state.params.end()) continue;  // no state for it yet (never stepped)
    const checkpoint::ShardedState::Param& saved = it->second;
    const at::Tensor& p = all_params_[static_cast<size_t>(param)];
    TORCH_CHECK(saved.range.begin == range.begin && saved.range.end == range.end, "load_sharded_state: parameter ",
                param, " holds elements [", saved.range.begin, ", ", saved.range.end, ") in the given state, but rank ",
                rank(), " owns [", range.begin, ", ", range.end, "); ask checkpoint::load_sharded for owned_ranges()");
    TORCH_CHECK(c10::IntArrayRef(saved.shape).equals(p.sizes()), "load_sharded_state: parameter ", param,
                " has shape ", c10::IntArrayRef(saved.shape), " in the given state but ", p.sizes(), " here");
    c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    for (const auto& e : saved.entries) {
      const c10::IValue& v = e.value();
      if (v.isTensor() && v.toTensor().dim() > 0) {
        const at::Tensor t = v.toTensor();
        TORCH_CHECK(t.numel() == range.size(), "load_sharded_state: entry '", e.key().toStringRef(), "' of parameter ",
                    param, " has ", t.numel(), " elements for a range of ", range.size());
        entry.insert(e.key(), flat() ? t.reshape(-1) : t.reshape(p.sizes()));
      } else {
        entry.insert(e.key(), v);
      }
    }
    local_state.insert(static_cast<int64_t>(k), entry);
  }
  load_local_state(state.param_groups.toList(), std::move(local_state));
}

absl::Status ZeroRedundancyOptimizer::save_sharded(const std::string& dir, const c10::IValue& extra) {
  checkpoint::ShardedState mine = sharded_state();
  mine.extra = extra;
  return checkpoint::save_sharded(options_.group, dir, mine, flat() ? "zero_flat" : "zero_whole_parameters");
}

absl::StatusOr<c10::IValue> ZeroRedundancyOptimizer::load_sharded(const std::string& dir) {
  absl::StatusOr<checkpoint::ShardedInfo> info = checkpoint::read_sharded_info(dir);
  if (!info.ok()) return info.status();
  // The saved parameters are the ones that had state; each must be one of ours, shaped the same.
  for (const auto& [param, shape] : info->shapes) {
    if (param < 0 || param >= static_cast<int64_t>(all_params_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("ZeRO checkpoint ", dir, " has state for parameter ", param,
                                                     " but this optimizer has ", all_params_.size(),
                                                     " parameters; load it into the same model"));
    }
    const at::Tensor& p = all_params_[static_cast<size_t>(param)];
    if (!c10::IntArrayRef(shape).equals(p.sizes())) {
      return absl::InvalidArgumentError(absl::StrCat("ZeRO checkpoint ", dir, ": parameter ", param, " has shape [",
                                                     absl::StrJoin(shape, ", "), "] there but [",
                                                     absl::StrJoin(p.sizes(), ", "), "] here"));
    }
  }
  if (!info->param_groups.isList() || info->param_groups.toList().size() != param_groups_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ZeRO checkpoint ", dir, " has ", info->param_groups.isList() ? info->param_groups.toList().size() : 0,
        " parameter groups, this optimizer has ", param_groups_.size()));
  }
  std::map<int64_t, checkpoint::ElementRange> wanted;
  for (const auto& [param, range] : owned_ranges()) {
    if (info->shapes.count(param) > 0) wanted[param] = range;
  }
  absl::StatusOr<checkpoint::ShardedState> state = checkpoint::load_sharded(dir, wanted);
  if (!state.ok()) return state.status();
  try {
    load_sharded_state(*state);
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(absl::StrCat("ZeRO checkpoint ", dir, ": ", e.what_without_backtrace()));
  }
  return state->extra;
}

class ZeroJoinHook : public comm::JoinHook {
 public:
  explicit ZeroJoinHook(ZeroRedundancyOptimizer* zero) : zero_(zero) {}
  // Shadows one step of the ranks still training: update and broadcast this rank's shard.
  void main_hook() override {
    zero_->in_join_hook_ = true;
    try {
      zero_->step();
    } catch (...) {
      zero_->in_join_hook_ = false;
      throw;
    }
    zero_->in_join_hook_ = false;
  }

 private:
  ZeroRedundancyOptimizer* zero_;
};

std::unique_ptr<comm::JoinHook> ZeroRedundancyOptimizer::join_hook(const comm::JoinOptions&) {
  return std::make_unique<ZeroJoinHook>(this);
}

c10::Device ZeroRedundancyOptimizer::join_device() const { return all_params_.at(0).device(); }

c10::intrusive_ptr<comm::C10dGroup> ZeroRedundancyOptimizer::join_process_group() const {
  return options_.group.pg();
}

int64_t ZeroRedundancyOptimizer::local_state_bytes() { return state_tensor_bytes(local_state_dict(*local_)); }

}  // namespace dtrain::optim
