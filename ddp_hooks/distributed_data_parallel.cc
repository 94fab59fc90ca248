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
#include "ddp_hooks/internal/ddp_state.h"
#include "ddp_hooks/libtorch_compat.h"

namespace dtrain::ddp_hooks {

namespace {

std::string describe(const std::string& name, const at::Tensor& t) {
  return absl::StrCat(name, " ", c10::toString(t.scalar_type()), " [",
                      absl::StrJoin(t.sizes(), ", "), "]");
}

using State = DistributedDataParallel::State;

// The model broadcasts send bfloat16 and float16 tensors as bytes (comm::wire_view).
using comm::wire_view;

// The parameters that require a gradient (dense, all on one device, which an NCCL group needs to
// be CUDA) and the buffers, in registration order.
void collect_parameters(State& s, torch::nn::Module& module) {
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    TORCH_CHECK(item.value().layout() == at::kStrided, "DistributedDataParallel: parameter '",
                item.key(), "' is sparse, which is not supported");
    s.names.push_back(item.key());
    s.params.push_back(item.value());
  }
  TORCH_CHECK(!s.params.empty(),
              "DistributedDataParallel is not needed when a module doesn't have any parameter that "
              "requires a gradient.");
  // One device per rank: buckets, hooks and Join hold one device (README, "Differences from PyTorch").
  for (size_t i = 1; i < s.params.size(); ++i) {
    TORCH_CHECK(s.params[i].device() == s.params[0].device(),
                "DistributedDataParallel: parameter '", s.names[i], "' is on ",
                s.params[i].device(), " but '", s.names[0], "' is on ", s.params[0].device(),
                "; a module spread over several devices is not supported: move the whole module to "
                "one device "
                "per rank (module->to(group.device()))");
  }
  TORCH_CHECK(!s.options.group.device().is_cuda() || s.params[0].is_cuda(),
              "DistributedDataParallel: the module is on ", s.params[0].device(),
              " but the group is NCCL's, which reduces CUDA tensors only: move the module to ",
              s.options.group.device(), " (group.device()), or use a Gloo group for a CPU module");
  for (const auto& item : module.named_buffers(/*recurse=*/true)) s.buffers.push_back(item.value());
}

// Same model everywhere, or a clear error naming the first difference; then rank 0's parameters
// and buffers everywhere. A collective.
void agree_on_model(State& s) {
  std::vector<std::string> mine;
  for (size_t i = 0; i < s.params.size(); ++i) mine.push_back(describe(s.names[i], s.params[i]));
  const absl::Status same = comm::check_identical(s.options.group, mine, "parameter");
  TORCH_CHECK(!absl::IsInvalidArgument(same),
              "DistributedDataParallel expects the same model on every rank: ", same.message());
  TORCH_CHECK(same.ok(), "DistributedDataParallel construction is a collective: ", same.ToString());
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> state;
  for (const auto& p : s.params) state.push_back(wire_view(p.detach()));
  for (const auto& b : s.buffers) state.push_back(wire_view(b.detach()));
  comm::broadcast_coalesced(s.options.group, state, 0, int64_t{250} << 20).wait();
}

// Buckets in reverse registration order (gradients become ready roughly back to front), one
// dtype per bucket, the first bucket of each dtype small so communication starts early; each with
// its zeroed buffer.
void assign_buckets(State& s) {
  std::map<at::ScalarType, std::pair<size_t, int64_t>> open;  // dtype -> (bucket, bytes)
  std::map<at::ScalarType, int> closed;
  s.where.resize(s.params.size());
  for (size_t k = s.params.size(); k-- > 0;) {
    const at::Tensor& p = s.params[k];
    auto it = open.find(p.scalar_type());
    if (it == open.end()) {
      s.buckets.emplace_back();
      it = open.emplace(p.scalar_type(), std::make_pair(s.buckets.size() - 1, int64_t{0})).first;
    }
    State::Bucket& bucket = s.buckets[it->second.first];
    const size_t offset =
        bucket.offsets.empty() ? 0 : bucket.offsets.back() + bucket.lengths.back();
    s.where[k] = {it->second.first, bucket.params.size()};
    bucket.params.push_back(k);
    bucket.offsets.push_back(offset);
    bucket.lengths.push_back(static_cast<size_t>(p.numel()));
    bucket.sizes.push_back(p.sizes());
    it->second.second += p.numel() * static_cast<int64_t>(p.element_size());
    const double cap_mb =
        closed[p.scalar_type()] == 0 ? s.options.first_bucket_cap_mb : s.options.bucket_cap_mb;
    if (static_cast<double>(it->second.second) >= cap_mb * 1024 * 1024) {
      ++closed[p.scalar_type()];
      open.erase(it);
    }
  }
  for (State::Bucket& bucket : s.buckets) {
    bucket.numel = static_cast<int64_t>(bucket.offsets.back() + bucket.lengths.back());
    bucket.options = s.params[bucket.params[0]].options();
    bucket.buffer = at::zeros({bucket.numel}, bucket.options);
  }
}

// A post hook on every parameter's gradient accumulator: on_grad_ready while the state lives.
void hook_grad_accumulators(State& s, const std::weak_ptr<State>& weak) {
  for (size_t i = 0; i < s.params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(s.params[i]);
    TORCH_CHECK(acc != nullptr, "DDP: parameter '", s.names[i],
                "' has no gradient accumulator (not a leaf?)");
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list&) {
          if (auto st = weak.lock()) st->on_grad_ready(i);
          return outputs;
        }));
    s.accumulators.push_back(std::move(acc));
  }
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 DDPOptions options)
    : module_(std::move(module)), state_(std::make_shared<State>()) {
  TORCH_CHECK(module_ != nullptr, "DistributedDataParallel needs a module");
  TORCH_CHECK(options.group.is_member(),
              "DistributedDataParallel: DDPOptions::group is not set or this rank is not in it");
  TORCH_CHECK(options.bucket_cap_mb > 0 && options.first_bucket_cap_mb > 0,
              "bucket caps must be positive");
  State& s = *state_;
  s.self = state_;
  s.options = std::move(options);
  collect_parameters(s, *module_);
  agree_on_model(s);
  assign_buckets(s);
  s.ready.assign(s.params.size(), false);
  s.reset();
  if (s.options.gradient_as_bucket_view) {
    for (size_t i = 0; i < s.params.size(); ++i) {
      at::Tensor view = s.bucket_view(i);
      if (s.params[i].grad().defined()) view.copy_(s.params[i].grad());
      s.params[i].mutable_grad() = s.grad_alias(i);
    }
  }
  s.hook = std::make_unique<AllReduceHook>(s.options.group);
  hook_grad_accumulators(s, state_);
}

DistributedDataParallel::~DistributedDataParallel() = default;

void DistributedDataParallel::pre_forward() {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.pending_error.empty()) {
      std::string message = std::move(s.pending_error);
      s.pending_error.clear();
      TORCH_CHECK(false, message);
    }
  }
  // Inside a Join: the same per-iteration collectives, in the same order, as a joined rank's
  // hook runs: the join count, the buffers, whether this iteration syncs gradients.
  comm::Join::notify_join_context(*this);
  sync_buffers();
  if (join_enabled()) {
    // Joined ranks add 0 to the same call (shadow_backward), so the sum counts the active ranks
    // (all ranks follow the same no_sync pattern, so 0 means nobody syncs).
    std::vector<at::Tensor> flag = {at::full(
        {1}, s.sync ? 1 : 0, at::TensorOptions().dtype(at::kInt).device(s.options.group.device()))};
    s.options.group->allreduce(flag)->wait();
    std::lock_guard<std::mutex> lock(s.mu);
    s.active_ranks = flag[0].item<int>();
  } else {
    std::lock_guard<std::mutex> lock(s.mu);
    s.active_ranks = 0;
  }
}

void DistributedDataParallel::sync_buffers() {
  State& s = *state_;
  if (s.options.broadcast_buffers && !s.buffers.empty() && s.options.group.size() > 1) {
    c10::NoGradGuard no_grad;
    std::vector<at::Tensor> buffers;
    for (const auto& b : s.buffers) buffers.push_back(wire_view(b.detach()));
    comm::broadcast_coalesced(s.options.group, buffers, 0).wait();
  }
}

void DistributedDataParallel::shadow_backward() {
  State& s = *state_;
  sync_buffers();
  std::vector<at::Tensor> flag = {
      at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(s.options.group.device()))};
  s.options.group->allreduce(flag)->wait();
  if (flag[0].item<int>() == 0) return;  // every working rank is in no_sync: nothing to match
  std::lock_guard<std::mutex> lock(s.mu);
  // One reduction per bucket, in order, with zeros (results discarded: this rank does not step).
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    State::Bucket& bucket = s.buckets[b];
    at::Tensor zeros = at::zeros({bucket.numel}, bucket.options);
    std::vector<at::Tensor> params;
    for (size_t i : bucket.params) params.push_back(s.params[i]);
    c10d::GradBucket grad_bucket = make_grad_bucket(b, s.buckets.size(), zeros, bucket.offsets,
                                                    bucket.lengths, bucket.sizes, params);
    s.hook->runHook(grad_bucket)->waitAndThrow();
  }
  if (s.consumer != nullptr) s.consumer->finish_backward();
  if (s.options.find_unused_parameters) {
    std::vector<at::Tensor> used = {
        at::zeros({static_cast<int64_t>(s.params.size())},
                  at::TensorOptions().dtype(at::kInt).device(s.options.group.device()))};
    s.options.group->allreduce(used)->wait();
  }
}

void DistributedDataParallel::sync_final_model(bool is_last_joiner) {
  State& s = *state_;
  // The last rank to join trained longest: its model is the authoritative one.
  std::vector<at::Tensor> who = {
      at::full({1}, is_last_joiner ? s.options.group.rank() : -1,
               at::TensorOptions().dtype(at::kInt).device(s.options.group.device()))};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  s.options.group->allreduce(who, max)->wait();
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> state;
  for (const auto& p : s.params) state.push_back(wire_view(p.detach()));
  for (const auto& b : s.buffers) state.push_back(wire_view(b.detach()));
  comm::broadcast_coalesced(s.options.group, state, who[0].item<int>()).wait();
}

class DDPJoinHook : public comm::JoinHook {
 public:
  explicit DDPJoinHook(DistributedDataParallel* ddp) : ddp_(ddp) {}
  void main_hook() override { ddp_->shadow_backward(); }
  void post_hook(bool is_last_joiner) override { ddp_->sync_final_model(is_last_joiner); }

 private:
  DistributedDataParallel* ddp_;
};

std::unique_ptr<comm::JoinHook> DistributedDataParallel::join_hook(
    const comm::JoinOptions& options) {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (const auto* refusing = dynamic_cast<const NotJoinable*>(state_->hook.get())) {
    TORCH_CHECK(false, "DistributedDataParallel cannot join: ", refusing->why_not_joinable());
  }
  state_->divide_by_initial_world_size = options.divide_by_initial_world_size;
  return std::make_unique<DDPJoinHook>(this);
}

c10::Device DistributedDataParallel::join_device() const { return state_->params.at(0).device(); }

c10::intrusive_ptr<comm::C10dGroup> DistributedDataParallel::join_process_group() const {
  return state_->options.group.pg();
}

void DistributedDataParallel::register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook) {
  TORCH_CHECK(hook != nullptr, "register_comm_hook: null hook");
  std::lock_guard<std::mutex> lock(state_->mu);
  State& s = *state_;
  TORCH_CHECK(!s.custom_hook,
              "register_comm_hook or register_builtin_comm_hook can only be called once.");
  auto* consumer = dynamic_cast<GradientConsumer*>(hook.get());
  if (consumer != nullptr) {
    TORCH_CHECK(!s.options.gradient_as_bucket_view,
                "this communication hook shards the gradients (ZeRO-2) and frees "
                "each bucket once reduced, which gradient_as_bucket_view would keep as every "
                "parameter's .grad: set "
                "DDPOptions::gradient_as_bucket_view = false");
    TORCH_CHECK(
        !s.options.find_unused_parameters,
        "this communication hook shards the gradients (ZeRO-2), which "
        "does not support find_unused_parameters yet (a parameter unused on every rank would be "
        "stepped with "
        "a zero gradient): set DDPOptions::find_unused_parameters = false and use every parameter");
    for (State::Bucket& bucket : s.buckets) bucket.buffer = at::Tensor();
  }
  s.hook = std::move(hook);
  s.consumer = consumer;
  s.custom_hook = true;
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel* ddp) : ddp_(ddp) {
  std::lock_guard<std::mutex> lock(ddp_->state_->mu);
  previous_ = ddp_->state_->sync;
  ddp_->state_->sync = false;
}

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() {
  if (ddp_ == nullptr) return;
  std::lock_guard<std::mutex> lock(ddp_->state_->mu);
  ddp_->state_->sync = previous_;
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : ddp_(other.ddp_), previous_(other.previous_) {
  other.ddp_ = nullptr;
}

DistributedDataParallel::NoSyncGuard DistributedDataParallel::no_sync() {
  return NoSyncGuard(this);
}

std::vector<std::vector<size_t>> DistributedDataParallel::bucket_indices() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : state_->buckets) out.push_back(b.params);
  return out;
}

const std::vector<std::string>& DistributedDataParallel::parameter_names() const {
  return state_->names;
}

const std::vector<at::Tensor>& DistributedDataParallel::parameters() const {
  return state_->params;
}

const comm::Group& DistributedDataParallel::group() const { return state_->options.group; }

}  // namespace dtrain::ddp_hooks
