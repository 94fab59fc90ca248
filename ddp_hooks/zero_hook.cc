#include "ddp_hooks/zero_hook.h"

#include <unordered_map>

#include <ATen/ATen.h>

#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/internal/ordered_worker.h"

#include "optim/zero/grad_shards.h"
#include "optim/zero/overlap.h"
#include "partition/bucket_assignment.h"

namespace dtrain::ddp_hooks {
namespace {

// ZeRO's parameter index of every DDP parameter, per DDP bucket (and their sizes). Errors name a
// DDP parameter ZeRO lacks, or a ZeRO parameter DDP does not reduce.
std::vector<std::vector<int64_t>> zero_indices_by_bucket(
    const DistributedDataParallel& ddp, const optim::ZeroRedundancyOptimizer& zero,
    const char* hook, std::vector<std::vector<int64_t>>* numels) {
  const auto& zero_params = zero.parameters();
  std::unordered_map<const c10::TensorImpl*, int64_t> zero_index;
  for (size_t i = 0; i < zero_params.size(); ++i)
    zero_index[zero_params[i].unsafeGetTensorImpl()] = static_cast<int64_t>(i);
  const auto& ddp_params = ddp.parameters();
  std::vector<bool> covered(zero_params.size(), false);
  std::vector<std::vector<int64_t>> out;
  for (const auto& bucket : ddp.bucket_indices()) {
    out.emplace_back();
    if (numels != nullptr) numels->emplace_back();
    for (size_t d : bucket) {
      auto it = zero_index.find(ddp_params[d].unsafeGetTensorImpl());
      TORCH_CHECK(it != zero_index.end(), hook, ": DDP parameter '", ddp.parameter_names()[d],
                  "' is not a parameter of the ZeroRedundancyOptimizer; build it over the same "
                  "parameters as DDP");
      covered[it->second] = true;
      out.back().push_back(it->second);
      if (numels != nullptr) numels->back().push_back(ddp_params[d].numel());
    }
  }
  for (size_t i = 0; i < covered.size(); ++i) {
    TORCH_CHECK(covered[i], hook, ": ZeroRedundancyOptimizer parameter ", i,
                " is not reduced by DDP (frozen, or from another module); build ZeRO over DDP's "
                "parameters only");
  }
  return out;
}

}  // namespace

ZeroOverlapHook::ZeroOverlapHook(std::unique_ptr<c10d::CommHookInterface> inner,
                                 const DistributedDataParallel& ddp,
                                 optim::ZeroRedundancyOptimizer& zero, bool shard_buckets,
                                 ZeroStepSchedule schedule)
    : inner_(std::move(inner)), zero_(zero), schedule_(schedule) {
  TORCH_CHECK(inner_ != nullptr,
              "hook_with_zero_step needs the hook that reduces the gradients (e.g. AllReduceHook)");
  TORCH_CHECK(zero.overlap_with_ddp(),
              "hook_with_zero_step needs a ZeroRedundancyOptimizer built with "
              "ZeroOptions::overlap_with_ddp = true");
  std::vector<std::vector<int64_t>> numels;
  bucket_params_ = zero_indices_by_bucket(ddp, zero, "hook_with_zero_step", &numels);
  absl::StatusOr<partition::BucketPartition> bp =
      partition::assign_ddp_buckets(numels, zero.world_size(), shard_buckets);
  TORCH_CHECK(bp.ok(), "hook_with_zero_step: ", bp.status().message());
  // Owners' parameters in bucket order, so a bucket's slice is contiguous in its owner's ZeRO
  // bucket view and goes out as one broadcast.
  std::vector<std::vector<int64_t>> params_per_rank(zero.world_size());
  for (size_t b = 0; b < bucket_params_.size(); ++b) {
    for (int r = 0; r < zero.world_size(); ++r) {
      auto it = bp->per_rank[r].find(static_cast<int64_t>(b));
      if (it == bp->per_rank[r].end()) continue;
      for (int64_t k = 0; k < it->second.num_params; ++k) {
        params_per_rank[r].push_back(bucket_params_[b][it->second.param_offset + k]);
      }
    }
  }
  optim::ZeroOverlap(zero).set_partition(std::move(params_per_rank));
  pending_.resize(bucket_params_.size());
  worker_ = internal::OrderedWorker::for_group(ddp.group());
}

ZeroOverlapHook::~ZeroOverlapHook() {
  if (last_) last_->wait();  // no job may outlive the hook
}

c10::intrusive_ptr<c10::ivalue::Future> ZeroOverlapHook::runHook(c10d::GradBucket& bucket) {
  const size_t b = bucket.getIndex();
  TORCH_CHECK(b == expected_ && b < pending_.size(), "ZeRO overlap hook: expected bucket ",
              expected_, " of ", pending_.size(), " but DDP reduced bucket ", b,
              "; register the hook on the DDP it was built for");
  expected_ = bucket.isLast() ? 0 : expected_ + 1;
  last_ = worker_->submit([this, bucket]() mutable { return run(bucket); }, bucket.getBufferRef());
  return last_;
}

c10::intrusive_ptr<c10::ivalue::Future> ZeroOverlapHook::run(c10d::GradBucket& bucket) {
  const size_t b = bucket.getIndex();
  pending_[b].future = inner_->runHook(bucket);
  pending_[b].layout = bucket.getGradients();
  pending_[b].buffer = bucket.getBuffer();
  // Every rank issues the collectives in the same order (interleaved: all-reduce b, broadcast
  // b-1; after backward: every all-reduce, then every broadcast), so they pair up.
  if (schedule_ == ZeroStepSchedule::kInterleaved && b > 0) {
    // Bucket b-1's reduction ran while bucket b's gradients were computed: step it now, so its
    // broadcast overlaps with the rest of backward.
    step_bucket(b - 1);
  }
  if (bucket.isLast()) {
    const size_t first = schedule_ == ZeroStepSchedule::kInterleaved ? b : 0;
    for (size_t k = first; k <= b; ++k) step_bucket(k);
    for (auto& w : broadcasts_) w->wait();
    broadcasts_.clear();
  }
  return pending_[b].future;
}

void ZeroOverlapHook::step_bucket(size_t b) {
  Pending& p = pending_[b];
  p.future->wait();
  at::Tensor result = inner_->parseHookResult(p.future->value());
  std::vector<at::Tensor> grads;
  grads.reserve(p.layout.size());
  if (result.is_same(p.buffer)) {
    grads = p.layout;
  } else {
    // The hook returned a new tensor: the same layout over it.
    int64_t offset = 0;
    for (const at::Tensor& g : p.layout) {
      grads.push_back(result.narrow(0, offset, g.numel()).view(g.sizes()));
      offset += g.numel();
    }
  }
  optim::ZeroOverlap overlap(zero_);
  overlap.step(bucket_params_[b], grads);
  for (auto& w : overlap.broadcast(bucket_params_[b])) broadcasts_.push_back(std::move(w));
  p.layout.clear();
  p.buffer = at::Tensor();
}

at::Tensor ZeroOverlapHook::parseHookResult(const c10::IValue& result) {
  return inner_->parseHookResult(result);
}

std::string ZeroOverlapHook::why_not_joinable() const {
  return "the ZeRO overlap hook steps the optimizer inside the gradient reduction, and a joined "
         "rank's shadow "
         "reductions would step it with zero gradients (PyTorch's hook does that silently); give "
         "every rank the same "
         "number of inputs, or use ZeroRedundancyOptimizer without overlap_with_ddp inside the "
         "Join";
}

std::unique_ptr<c10d::CommHookInterface> hook_with_zero_step(
    std::unique_ptr<c10d::CommHookInterface> inner, const DistributedDataParallel& ddp,
    optim::ZeroRedundancyOptimizer& zero, bool shard_buckets) {
  return std::make_unique<ZeroOverlapHook>(std::move(inner), ddp, zero, shard_buckets,
                                           ZeroStepSchedule::kAfterBackward);
}

std::unique_ptr<c10d::CommHookInterface> hook_with_zero_step_interleaved(
    std::unique_ptr<c10d::CommHookInterface> inner, const DistributedDataParallel& ddp,
    optim::ZeroRedundancyOptimizer& zero, bool shard_buckets) {
  return std::make_unique<ZeroOverlapHook>(std::move(inner), ddp, zero, shard_buckets,
                                           ZeroStepSchedule::kInterleaved);
}

ZeroGradShardHook::ZeroGradShardHook(const DistributedDataParallel& ddp,
                                     optim::ZeroRedundancyOptimizer& zero)
    : zero_(zero), group_(ddp.group()) {
  TORCH_CHECK(zero.shard_gradients(),
              "hook_with_zero2 needs a ZeroRedundancyOptimizer built with "
              "ZeroOptions::shard_gradients = true");
  TORCH_CHECK(zero.process_group().global_ranks() == group_.global_ranks(),
              "hook_with_zero2: DDP and the "
              "ZeroRedundancyOptimizer must use the same group (the gradients are reduce-scattered "
              "over it)");
  std::vector<std::vector<int64_t>> buckets =
      zero_indices_by_bucket(ddp, zero, "hook_with_zero2", nullptr);
  pending_.resize(buckets.size());
  exchanges_.resize(buckets.size());
  optim::ZeroGradShards(zero).set_buckets(std::move(buckets));
  worker_ = internal::OrderedWorker::for_group(group_);
}

ZeroGradShardHook::~ZeroGradShardHook() {
  if (last_) last_->wait();
}

c10::intrusive_ptr<c10::ivalue::Future> ZeroGradShardHook::runHook(c10d::GradBucket& bucket) {
  const size_t b = bucket.getIndex();
  TORCH_CHECK(b == expected_ && b < pending_.size(), "ZeRO-2 hook: expected bucket ", expected_,
              " of ", pending_.size(), " but DDP reduced bucket ", b,
              "; register the hook on the DDP it was built for");
  ++expected_;
  last_ = worker_->submit([this, bucket]() mutable { return run(bucket); }, bucket.getBufferRef(),
                          /*max_waiting=*/2);
  return last_;
}

c10::intrusive_ptr<c10::ivalue::Future> ZeroGradShardHook::run(c10d::GradBucket& bucket) {
  const size_t b = bucket.getIndex();
  optim::ZeroGradShards shards(zero_);
  const at::Tensor& buffer = bucket.getBufferRef();
  TORCH_CHECK(buffer.numel() == shards.bucket_numel(b), "ZeRO-2 hook: bucket ", b, " has ",
              buffer.numel(), " elements, the optimizer's layout ", shards.bucket_numel(b));
  // Bucket b-1's reduction ran while bucket b's gradients were computed; finishing it here keeps
  // at most two reductions in flight.
  if (b > 0) finish(b - 1);
  const int64_t padded = shards.padded_numel(b);
  at::Tensor input = buffer;
  if (padded != buffer.numel()) {
    input = at::zeros({padded}, buffer.options());
    input.narrow(0, 0, buffer.numel()).copy_(buffer);
  }
  input.div_(group_.size());  // as the all-reduce hook: each rank's share of the average
  if (group_.size() > 1 && group_.backend() == "gloo" && !gloo_reduces(input.scalar_type())) {
    exchanges_[b] = exchange_bytes(input, shards.grad_chunk(b));
  } else {
    pending_[b] = comm::reduce_scatter_tensor(group_, shards.grad_chunk(b), input);
  }
  auto done = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  done->markCompleted(c10::IValue(buffer));
  return done;
}

ZeroGradShardHook::ByteExchange ZeroGradShardHook::exchange_bytes(const at::Tensor& input,
                                                                  const at::Tensor& output) {
  ByteExchange x;
  x.received = at::empty_like(input);
  std::vector<int64_t> equal_splits;  // empty: chunk r of the bytes goes to rank r
  at::Tensor out_bytes = x.received.view(at::kByte), in_bytes = input.view(at::kByte);
  x.work = group_.pg()->alltoall_base(out_bytes, in_bytes, equal_splits, equal_splits);
  x.received = x.received.view({group_.size(), output.numel()});
  x.output = output;
  return x;
}

void ZeroGradShardHook::finish(size_t b) {
  if (pending_[b].defined()) pending_[b].wait();
  pending_[b] = comm::ReduceScatterWork();
  ByteExchange& x = exchanges_[b];
  if (x.work) {
    x.work->wait();
    at::Tensor sum = x.received[0].to(at::kFloat);  // in rank order, as reduce_scatter_tensor
    for (int64_t r = 1; r < x.received.size(0); ++r) sum.add_(x.received[r]);
    x.output.copy_(sum);
    x = ByteExchange();
  }
}

void ZeroGradShardHook::finish_backward() {
  if (last_) last_->waitAndThrow();  // the worker is done with this backward's buckets
  for (size_t b = 0; b < pending_.size(); ++b) finish(b);
  TORCH_CHECK(expected_ == pending_.size(), "ZeRO-2 hook: backward ended after ", expected_, " of ",
              pending_.size(), " buckets");
  expected_ = 0;
  optim::ZeroGradShards(zero_).mark_reduced();
}

std::unique_ptr<c10d::CommHookInterface> hook_with_zero2(const DistributedDataParallel& ddp,
                                                         optim::ZeroRedundancyOptimizer& zero) {
  return std::make_unique<ZeroGradShardHook>(ddp, zero);
}

}  // namespace dtrain::ddp_hooks
