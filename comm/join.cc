#include "comm/join.h"

#include <ATen/ATen.h>

namespace dtrain::comm {

Join::Join(std::vector<Joinable*> joinables, JoinOptions options)
    : joinables_(std::move(joinables)), options_(options) {
  TORCH_CHECK(!joinables_.empty(), "The join context manager requires at least one joinable");
  for (size_t i = 0; i < joinables_.size(); ++i) {
    TORCH_CHECK(joinables_[i] != nullptr, "Join: joinable ", i, " is null");
  }
  process_group_ = joinables_[0]->join_process_group();
  device_ = joinables_[0]->join_device();
  for (size_t i = 1; i < joinables_.size(); ++i) {
    TORCH_CHECK(joinables_[i]->join_process_group().get() == process_group_.get(),
                "Using join context manager with multiple process groups: joinable ", i,
                " uses another group than joinable 0");
    TORCH_CHECK(joinables_[i]->join_device() == device_,
                "Using join context manager with multiple devices: joinable ", i, " is on ",
                joinables_[i]->join_device(), ", joinable 0 on ", device_);
  }
  for (size_t i = 0; i < joinables_.size(); ++i) {
    Joinable& j = *joinables_[i];
    j.join_enabled_ = options_.enable;
    j.is_first_joinable_ = i == 0;
    j.throw_on_early_termination_ = options_.throw_on_early_termination;
    hooks_.push_back(j.join_hook(options_));
    TORCH_CHECK(hooks_.back() != nullptr, "Join: joinable ", i, " returned a null join hook");
  }
}

Join::~Join() {
  for (Joinable* j : joinables_) {
    j->join_enabled_ = false;
    j->is_first_joinable_ = false;
    j->throw_on_early_termination_ = false;
  }
}

int Join::num_nonjoined_procs() {
  // Joined ranks contribute 0; working ranks' notify_join_context contributes 1 to the same call.
  std::vector<at::Tensor> t = {at::zeros({1}, at::TensorOptions().device(device_))};
  process_group_->allreduce(t)->wait();
  return static_cast<int>(t[0].item<int64_t>());
}

void Join::notify_procs_to_terminate() {
  std::vector<at::Tensor> t = {at::ones({1}, at::TensorOptions().device(device_))};
  process_group_->allreduce(t)->wait();
  TORCH_CHECK(false, "Rank ", process_group_->getRank(), " exhausted all inputs.");
}

void Join::finish() {
  TORCH_CHECK(!finished_, "Join::finish() called twice");
  finished_ = true;
  if (!options_.enable) return;
  bool is_last_joiner = true;
  while (true) {
    if (num_nonjoined_procs() == 0) break;
    if (options_.throw_on_early_termination) notify_procs_to_terminate();
    for (auto& h : hooks_) h->main_hook();
    is_last_joiner = false;
  }
  for (auto& h : hooks_) h->post_hook(is_last_joiner);
}

c10::intrusive_ptr<c10d::Work> Join::notify_join_context(Joinable& joinable) {
  if (!joinable.is_first_joinable_ || !joinable.join_enabled_) return {};
  auto pg = joinable.join_process_group();
  const auto opts = at::TensorOptions().device(joinable.join_device());
  std::vector<at::Tensor> ones = {at::ones({1}, opts)};
  auto work = pg->allreduce(ones);
  if (joinable.throw_on_early_termination_) {
    std::vector<at::Tensor> zeros = {at::zeros({1}, opts)};
    pg->allreduce(zeros)->wait();
    TORCH_CHECK(zeros[0].item<double>() == 0,
                "Detected at least one rank that exhausted inputs. Throwing across all ranks.");
  }
  return work;
}

}  // namespace dtrain::comm
