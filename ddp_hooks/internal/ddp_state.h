// DistributedDataParallel's state: the buckets, the gradient hooks that fill them, and the
// reduction of a backward pass; shared with its autograd hooks through a shared_ptr. Internal to
// ddp_hooks/ (distributed_data_parallel.cc is its one user).
#ifndef DTRAIN_DDP_HOOKS_INTERNAL_DDP_STATE_H_
#define DTRAIN_DDP_HOOKS_INTERNAL_DDP_STATE_H_

#include "ddp_hooks/distributed_data_parallel.h"

#include <map>
#include <mutex>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/agreement.h"
#include "comm/coalesced.h"
#include "comm/object_collectives.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/libtorch_compat.h"

namespace dtrain::ddp_hooks {

struct DistributedDataParallel::State {
  struct Bucket {
    std::vector<size_t> params;  // indices into State::params
    std::vector<size_t> offsets, lengths;
    std::vector<c10::IntArrayRef> sizes;
    int64_t numel = 0;
    at::TensorOptions options;
    at::Tensor buffer;  // undefined between backward passes with a GradientConsumer hook
    size_t pending = 0;
    c10::intrusive_ptr<c10::ivalue::Future> future;
  };

  DDPOptions options;
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<at::Tensor> buffers;
  std::vector<Bucket> buckets;
  std::vector<std::pair<size_t, size_t>> where;  // param -> (bucket, position)
  std::vector<GradAccumulatorPtr> accumulators;
  std::unique_ptr<c10d::CommHookInterface> hook;
  GradientConsumer* consumer = nullptr;  // `hook`, when it takes the gradients over
  bool custom_hook = false;
  // Join with divide_by_initial_world_size=false: ranks still training this iteration (0 when
  // not in a Join), to average over them instead of the initial world size.
  bool divide_by_initial_world_size = true;
  int active_ranks = 0;

  std::mutex mu;
  bool sync = true;
  bool in_backward = false;
  std::vector<bool> ready;
  size_t next_bucket = 0;
  std::string pending_error;

  at::Tensor bucket_view(size_t i) {
    const auto [b, k] = where[i];
    return buckets[b]
        .buffer
        .narrow(0, static_cast<int64_t>(buckets[b].offsets[k]),
                static_cast<int64_t>(buckets[b].lengths[k]))
        .view(params[i].sizes());
  }

  // The same memory as bucket_view(i), but not an autograd view: LibTorch's
  // Optimizer::zero_grad() calls detach_() on every gradient, which a view rejects.
  at::Tensor grad_alias(size_t i) {
    const auto [b, k] = where[i];
    const at::Tensor& buffer = buckets[b].buffer;
    const auto sizes = params[i].sizes();
    std::vector<int64_t> strides(sizes.size(), 1);
    for (size_t d = sizes.size(); d-- > 1;)
      strides[d - 1] = strides[d] * std::max<int64_t>(sizes[d], 1);
    at::Tensor alias = at::empty({0}, buffer.options());
    alias.set_(buffer.storage(),
               buffer.storage_offset() + static_cast<int64_t>(buckets[b].offsets[k]), sizes,
               strides);
    return alias;
  }

  // Makes .grad of parameter i the alias of its bucket slot, unless it already is.
  void point_grad_at_bucket(size_t i) {
    const at::Tensor& grad = params[i].grad();
    if (!grad.defined() || grad.data_ptr() != bucket_view(i).data_ptr())
      params[i].mutable_grad() = grad_alias(i);
  }

  // Puts parameter i's gradient into its bucket (or zeros when it has none). A consumer's
  // buckets are allocated for the pass, and the gradient released once copied.
  void gather_grad(size_t i) {
    Bucket& bucket = buckets[where[i].first];
    if (!bucket.buffer.defined()) bucket.buffer = at::empty({bucket.numel}, bucket.options);
    at::Tensor view = bucket_view(i);
    const at::Tensor& grad = params[i].grad();
    if (!grad.defined()) {
      view.zero_();
    } else if (!grad.is_same(view) && grad.data_ptr() != view.data_ptr()) {
      view.copy_(grad);
    }
    if (consumer != nullptr) params[i].mutable_grad() = at::Tensor();
    if (options.gradient_as_bucket_view) point_grad_at_bucket(i);
  }

  void launch_ready_buckets() {
    // Buckets are reduced in order on every rank, so the collectives pair up.
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) {
      Bucket& bucket = buckets[next_bucket];
      std::vector<at::Tensor> bucket_params;
      for (size_t i : bucket.params) bucket_params.push_back(params[i]);
      c10d::GradBucket grad_bucket =
          make_grad_bucket(next_bucket, buckets.size(), bucket.buffer, bucket.offsets,
                           bucket.lengths, bucket.sizes, bucket_params);
      bucket.future = hook->runHook(grad_bucket);
      if (consumer != nullptr) bucket.buffer = at::Tensor();  // the hook keeps what it needs
      ++next_bucket;
    }
  }

  void mark_ready(size_t i) {
    TORCH_CHECK(!ready[i], "DDP: parameter '", names[i],
                "' was marked ready twice in one backward pass; this happens "
                "when a parameter is used by two autograd graphs or reentrant backward. Call "
                "backward once per "
                "forward.");
    ready[i] = true;
    gather_grad(i);
    Bucket& bucket = buckets[where[i].first];
    --bucket.pending;
    launch_ready_buckets();
  }

  // Autograd post-hook of parameter i's gradient accumulator.
  void on_grad_ready(size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    if (!sync) return;
    if (!in_backward) {
      in_backward = true;
      std::weak_ptr<State> weak = self;
      torch::autograd::Engine::get_default_engine().queue_callback([weak] {
        if (auto s = weak.lock()) s->finalize();
      });
    }
    mark_ready(i);
  }

  void finalize() {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<size_t> unused;
    for (size_t i = 0; i < params.size(); ++i) {
      if (!ready[i]) unused.push_back(i);
    }
    std::vector<bool> locally_used = ready;
    // Missing gradients still go through their buckets as zeros, so every rank launches the
    // same collectives.
    for (size_t i : unused) mark_ready(i);
    if (consumer != nullptr) {
      for (Bucket& bucket : buckets) bucket.future->waitAndThrow();
      consumer->finish_backward();
      if (!unused.empty()) pending_error = unused_parameters_error(unused);
      reset();
      return;
    }
    // Every bucket's reduction first: a hook may still be issuing collectives on its own thread
    // (ordered_worker.h), and the flags' all-reduce below must come after them on every rank.
    const int world = options.group.size();
    // As PyTorch's reducer: only the built-in all-reduce honours divide_by_initial_world_size;
    // it divided by the world size, joined ranks sent zeros, so rescale to the active ranks.
    const bool rescale =
        !divide_by_initial_world_size && !custom_hook && active_ranks > 0 && active_ranks < world;
    for (Bucket& bucket : buckets) {
      bucket.future->wait();
      at::Tensor result = hook->parseHookResult(bucket.future->value());
      if (!result.is_same(bucket.buffer)) bucket.buffer.copy_(result);
      if (rescale) bucket.buffer.mul_(static_cast<double>(world) / active_ranks);
    }
    at::Tensor globally_used;
    if (options.find_unused_parameters) {
      globally_used = at::zeros({static_cast<int64_t>(params.size())}, at::kInt);
      int* used =
          globally_used.data_ptr<int>();  // element-wise tensor indexing costs a dispatch each
      for (size_t i = 0; i < params.size(); ++i) used[i] = locally_used[i] ? 1 : 0;
      // On the group's device (NCCL refuses CPU tensors), read back on the CPU.
      std::vector<at::Tensor> t = {globally_used.to(options.group.device())};
      options.group->allreduce(t)->wait();
      globally_used = t[0].cpu();
    } else if (!unused.empty()) {
      pending_error = unused_parameters_error(unused);
    }
    for (size_t i = 0; i < params.size(); ++i) {
      if (globally_used.defined() && globally_used.data_ptr<int>()[i] == 0) {
        continue;  // unused on every rank: leave .grad as it was
      }
      if (options.gradient_as_bucket_view) {
        point_grad_at_bucket(i);
      } else if (params[i].grad().defined()) {
        params[i].mutable_grad().copy_(bucket_view(i));
      } else {
        params[i].mutable_grad() = bucket_view(i).clone();
      }
    }
    reset();
  }

  std::string unused_parameters_error(const std::vector<size_t>& unused) const {
    std::vector<std::string> which;
    for (size_t i : unused) which.push_back(absl::StrCat(names[i], " (index ", i, ")"));
    return absl::StrCat(
        "Expected to have finished reduction in the prior iteration before starting a new one. "
        "This error indicates "
        "that your module has parameters that were not used in producing loss. You can enable "
        "unused parameter "
        "detection by setting find_unused_parameters=true in DDPOptions. Parameters which did not "
        "receive grad "
        "for rank ",
        options.group.rank(), ": ", absl::StrJoin(which, ", "));
  }

  void reset() {
    for (Bucket& bucket : buckets) {
      bucket.pending = bucket.params.size();
      bucket.future.reset();
    }
    std::fill(ready.begin(), ready.end(), false);
    next_bucket = 0;
    in_backward = false;
  }

  std::weak_ptr<State> self;
};

}  // namespace dtrain::ddp_hooks

#endif  // DTRAIN_DDP_HOOKS_INTERNAL_DDP_STATE_H_
