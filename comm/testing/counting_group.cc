#include "comm/testing/counting_group.h"

#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "comm/libtorch_compat.h"

namespace dtrain::comm {

void ByteCounter::add(const std::string& collective, int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "ByteCounter::add(\"", collective, "\", ", bytes,
              "): byte counts cannot be negative");
  std::lock_guard<std::mutex> lock(mu_);
  CollectiveCounts& c = counts_[collective];
  c.calls += 1;
  c.bytes += bytes;
}

std::map<std::string, CollectiveCounts> ByteCounter::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

int64_t ByteCounter::total_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const auto& [name, c] : counts_) total += c.bytes;
  return total;
}

void ByteCounter::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  counts_.clear();
}

namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }
int64_t bytes_of(const std::vector<at::Tensor>& ts) {
  int64_t b = 0;
  for (const auto& t : ts) b += bytes_of(t);
  return b;
}
int64_t bytes_of(const std::vector<std::vector<at::Tensor>>& tss) {
  int64_t b = 0;
  for (const auto& ts : tss) b += bytes_of(ts);
  return b;
}

// Forwards every collective to `inner_` and counts it (table in counting_group.h) once the
// forwarded call has returned, so a call that throws is not counted.
class CountingGroup final : public C10dGroup {
 public:
  CountingGroup(c10::intrusive_ptr<C10dGroup> inner, std::shared_ptr<ByteCounter> counter)
      : C10dGroup(inner->getRank(), inner->getSize()),
        inner_(std::move(inner)),
        counter_(std::move(counter)) {}

  const std::string getBackendName() const override { return inner_->getBackendName(); }
  // Overrides Backend::shutdown where it has one (libtorch_compat.h): destroy_process_group of a
  // counting view shuts the group it counts down.
  void shutdown() { shutdown_backend(*inner_); }

  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    return counted("broadcast", share(bytes_of(tensors)), inner_->broadcast(tensors, opts));
  }
  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    return counted("allreduce", ring_allreduce(bytes_of(tensors)),
                   inner_->allreduce(tensors, opts));
  }
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& tensors,
                              const c10d::AllreduceCoalescedOptions& opts) override {
    return counted("allreduce", ring_allreduce(bytes_of(tensors)),
                   inner_->allreduce_coalesced(tensors, opts));
  }
  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    return counted("reduce", share(bytes_of(tensors)), inner_->reduce(tensors, opts));
  }
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                    const c10d::AllgatherOptions& opts) override {
    return counted("allgather", others() * bytes_of(inputs),
                   inner_->allgather(outputs, inputs, opts));
  }
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input,
                          const c10d::AllgatherOptions& opts) override {
    return counted("allgather", others() * bytes_of(input),
                   inner_->_allgather_base(output, input, opts));
  }
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                              std::vector<at::Tensor>& inputs,
                              const c10d::AllgatherOptions& opts) override {
    return counted("allgather", others() * bytes_of(inputs),
                   inner_->allgather_coalesced(outputs, inputs, opts));
  }
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::GatherOptions& opts) override {
    const int64_t sent = getRank() == opts.rootRank ? 0 : bytes_of(inputs);
    return counted("gather", sent, inner_->gather(outputs, inputs, opts));
  }
  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts) override {
    const int64_t sent = getRank() == opts.rootRank ? others() * bytes_of(outputs) : 0;
    return counted("scatter", sent, inner_->scatter(outputs, inputs, opts));
  }
  WorkPtr reduce_scatter(std::vector<at::Tensor>& outputs,
                         std::vector<std::vector<at::Tensor>>& inputs,
                         const c10d::ReduceScatterOptions& opts) override {
    return counted("reduce_scatter", share(bytes_of(inputs)),
                   inner_->reduce_scatter(outputs, inputs, opts));
  }
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                               const c10d::ReduceScatterOptions& opts) override {
    return counted("reduce_scatter", share(bytes_of(input)),
                   inner_->_reduce_scatter_base(output, input, opts));
  }
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                        std::vector<int64_t>& input_splits,
                        const c10d::AllToAllOptions& opts) override {
    return counted("alltoall", share(bytes_of(input)),
                   inner_->alltoall_base(output, input, output_splits, input_splits, opts));
  }
  WorkPtr alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                   const c10d::AllToAllOptions& opts) override {
    return counted("alltoall", share(bytes_of(inputs)), inner_->alltoall(outputs, inputs, opts));
  }
  WorkPtr send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return counted("send", bytes_of(tensors), inner_->send(tensors, dst, tag));
  }
  WorkPtr recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return counted("recv", 0, inner_->recv(tensors, src, tag));
  }
  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return counted("recv", 0, inner_->recvAnysource(tensors, tag));
  }
  WorkPtr barrier(const c10d::BarrierOptions& opts) override {
    return counted("barrier", 0, inner_->barrier(opts));
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    inner_->monitoredBarrier(opts, wait_all_ranks);
    counter_->add("barrier", 0);
  }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }

 private:
  WorkPtr counted(const char* name, int64_t bytes, WorkPtr work) {
    counter_->add(name, bytes);
    return work;
  }
  int64_t others() const { return getSize() - 1; }
  // (n-1)/n of `bytes`, rounded down.
  int64_t share(int64_t bytes) const { return bytes * others() / getSize(); }
  // 2(n-1)/n of `bytes`, rounded down.
  int64_t ring_allreduce(int64_t bytes) const { return 2 * bytes * others() / getSize(); }

  c10::intrusive_ptr<C10dGroup> inner_;
  std::shared_ptr<ByteCounter> counter_;
};

}  // namespace

Group counting_group(const Group& group, std::shared_ptr<ByteCounter> counter) {
  TORCH_CHECK(counter != nullptr,
              "counting_group: the counter is null; pass std::make_shared<ByteCounter>()");
  const c10::intrusive_ptr<C10dGroup>& inner = group.pg();  // TORCH_CHECKs membership
  Group counted;
  counted.state_ = std::make_shared<Group::State>(*group.state_);
  counted.state_->pg = c10::make_intrusive<CountingGroup>(inner, std::move(counter));
  // Subgroups of the counting group get names of their own (see counting_group.h).
  counted.state_->prefix += "/counted";
  counted.state_->children = 0;
  return counted;
}

}  // namespace dtrain::comm
