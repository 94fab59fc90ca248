#include "ddp_hooks/default_hooks.h"

#include <cstdlib>
#include <map>
#include <mutex>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

namespace dtrain::ddp_hooks {
namespace {

c10::intrusive_ptr<c10::ivalue::Future> ready_future(const at::Tensor& t) {
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  fut->markCompleted(c10::IValue(t));
  return fut;
}

bool probe_gloo_reduces(at::ScalarType dtype) {
  comm::InitOptions o;
  o.store = c10::make_intrusive<c10d::HashStore>();
  o.rank = 0;
  o.world_size = 1;
  o.gloo_threads = 1;
  absl::StatusOr<comm::Group> alone = comm::init_process_group(o);
  if (!alone.ok()) return false;
  std::vector<at::Tensor> t = {at::ones({1}, at::TensorOptions().dtype(dtype))};
  try {
    (*alone)->allreduce(t)->wait();
    return true;
  } catch (const std::exception&) {
    return false;  // "Invalid scalar type"
  }
}

}  // namespace

bool gloo_reduces(at::ScalarType dtype) {
  static std::mutex mu;
  static std::map<at::ScalarType, bool> known;
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(dtype);
  if (it == known.end()) it = known.emplace(dtype, probe_gloo_reduces(dtype)).first;
  return it->second;
}

c10::intrusive_ptr<c10::ivalue::Future> allreduce_sum(const comm::Group& group,
                                                      const at::Tensor& t) {
  if (group.backend() != "gloo" || gloo_reduces(t.scalar_type())) {
    std::vector<at::Tensor> in = {t};
    return group->allreduce(in)->getFuture();
  }
  // Gather every rank's bytes (the same traffic as a ring all-reduce's for 2 ranks) and sum the
  // n parts here in float32, rounding once into t's dtype.
  std::vector<at::Tensor> mine = {t.view(at::kByte)};
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < group.size(); ++r) all[0].push_back(at::empty_like(mine[0]));
  auto fut = group->allgather(all, mine)->getFuture();
  return fut->then(
      [t, parts = all[0]](c10::ivalue::Future& gathered) {
        gathered.value();  // rethrows the gather's error
        at::Tensor sum = at::zeros(t.sizes(), t.options().dtype(at::kFloat));
        for (const auto& p : parts)
          sum.add_(p.view(t.scalar_type()).view(t.sizes()).to(at::kFloat));
        t.copy_(sum);
        return c10::IValue(t);
      },
      c10::TensorType::get());
}

c10::intrusive_ptr<c10::ivalue::Future> AllReduceHook::runHook(c10d::GradBucket& bucket) {
  at::Tensor& buffer = bucket.getBufferRef();
  buffer.div_(group_.size());
  return allreduce_sum(group_, buffer);
}

CompressHook::CompressHook(comm::Group group, at::ScalarType dtype)
    : group_(std::move(group)), dtype_(dtype) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "CompressHook compresses to float16 or bfloat16, got ", dtype);
}

int64_t CompressHook::buffers_allocated() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_;
}

CompressHook::Kept CompressHook::acquire(const at::Tensor& buffer, size_t index) {
  auto fresh = [&] {
    ++allocated_;
    return Kept{at::empty(buffer.sizes(), buffer.options().dtype(dtype_)),
                std::make_shared<std::atomic<bool>>(false)};
  };
  std::lock_guard<std::mutex> lock(mu_);
  Kept kept;
  if (!buffer.device().is_cpu()) {
    kept = fresh();  // device allocators cache memory themselves
  } else {
    if (kept_.size() <= index) kept_.resize(index + 1);
    Kept& mine = kept_[index];
    if (mine.tensor.defined() && mine.done->load() && mine.tensor.sizes().equals(buffer.sizes())) {
      mine.done = std::make_shared<std::atomic<bool>>(false);
    } else {
      mine = fresh();
    }
    kept = mine;
  }
  return kept;
}

c10::intrusive_ptr<c10::ivalue::Future> CompressHook::runHook(c10d::GradBucket& bucket) {
  at::Tensor buffer = bucket.getBufferRef();
  Kept kept = acquire(buffer, bucket.getIndex());
  at::Tensor compressed = kept.tensor.copy_(buffer).div_(group_.size());
  auto fut = allreduce_sum(group_, compressed);
  // Decompress into the bucket in place, as PyTorch's hook does.
  return fut->then(
      [buffer, compressed, done = kept.done](c10::ivalue::Future& reduced) {
        try {
          reduced
              .value();  // rethrows the all-reduce's error: a failed collective is never a result
        } catch (...) {
          done->store(true);
          throw;
        }
        buffer.copy_(compressed);
        done->store(true);
        return c10::IValue(buffer);
      },
      c10::TensorType::get());
}

CompressWrapper::CompressWrapper(std::unique_ptr<c10d::CommHookInterface> inner,
                                 at::ScalarType dtype)
    : inner_(std::move(inner)), dtype_(dtype) {
  TORCH_CHECK(inner_ != nullptr, "CompressWrapper needs a hook to wrap");
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "CompressWrapper compresses to float16 or bfloat16, got ", dtype);
}

c10::intrusive_ptr<c10::ivalue::Future> CompressWrapper::runHook(c10d::GradBucket& bucket) {
  at::Tensor original = bucket.getBufferRef();
  at::Tensor compressed = original.to(dtype_);
  bucket.setBuffer(compressed);
  auto fut = inner_->runHook(bucket);
  c10d::CommHookInterface* inner = inner_.get();
  return fut->then(
      [original, inner](c10::ivalue::Future& done) {
        // Decompress in place into the original bucket (no second full-size buffer).
        original.copy_(inner->parseHookResult(done.value()));
        return c10::IValue(original);
      },
      c10::TensorType::get());
}

PostLocalSGDState::PostLocalSGDState(comm::Group process_group, comm::Group subgroup,
                                     int64_t start_localSGD_iter,
                                     bool post_local_gradient_allreduce)
    : process_group(std::move(process_group)),
      subgroup(std::move(subgroup)),
      start_localSGD_iter(start_localSGD_iter),
      post_local_gradient_allreduce(post_local_gradient_allreduce) {
  TORCH_CHECK(this->process_group.is_member(),
              "PostLocalSGDState: the process group is not set or this rank is not in it");
  TORCH_CHECK(start_localSGD_iter >= 0, "start_localSGD_iter must be >= 0, got ",
              start_localSGD_iter);
}

PostLocalSGDHook::PostLocalSGDHook(std::shared_ptr<PostLocalSGDState> state)
    : StatefulHook(std::move(state), "PostLocalSGDHook") {}

c10::intrusive_ptr<c10::ivalue::Future> PostLocalSGDHook::runHook(c10d::GradBucket& bucket) {
  PostLocalSGDState& s = state();
  at::Tensor& input = bucket.getBufferRef();
  auto allreduce_in = [&](const comm::Group& group) {
    input.div_(group.size());
    std::vector<at::Tensor> t = {input};
    return group->allreduce(t)->getFuture();
  };
  if (s.iter < s.start_localSGD_iter) {
    if (bucket.isLast()) ++s.iter;  // the last bucket closes an iteration
    return allreduce_in(s.process_group);
  }
  if (!s.post_local_gradient_allreduce) return ready_future(input);
  if (!s.subgroup.is_member()) {
    // Every rank reaches this bucket together, so creating the subgroups here is safe.
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    TORCH_CHECK(
        local != nullptr,
        "post-local SGD started without a subgroup and LOCAL_WORLD_SIZE is not set: pass "
        "PostLocalSGDState::subgroup (e.g. comm::new_subgroups(world, ranks_per_node).mine)");
    auto sub = comm::new_subgroups(s.process_group, std::atoi(local));
    TORCH_CHECK(sub.ok(), "post-local SGD: ", sub.status().ToString());
    s.subgroup = sub->mine;
  }
  return allreduce_in(s.subgroup);
}

c10::intrusive_ptr<c10::ivalue::Future> NoOpHook::runHook(c10d::GradBucket& bucket) {
  return ready_future(bucket.getBuffer());
}

}  // namespace dtrain::ddp_hooks
