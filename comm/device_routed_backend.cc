#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "comm/internal/device_routed_backend.h"

namespace dtrain::comm::internal {
namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using Tensors = std::vector<at::Tensor>;
using TensorLists = std::vector<Tensors>;

class DeviceRoutedBackend final : public C10dGroup {
 public:
  DeviceRoutedBackend(c10::intrusive_ptr<C10dGroup> cpu, c10::intrusive_ptr<C10dGroup> cuda)
      : C10dGroup(cpu->getRank(), cpu->getSize()), cpu_(std::move(cpu)), cuda_(std::move(cuda)) {
    TORCH_CHECK(cuda_->getRank() == cpu_->getRank() && cuda_->getSize() == cpu_->getSize(),
                "DeviceRoutedBackend: the CPU and CUDA backends disagree on rank or size");
  }
  const std::string getBackendName() const override { return "cpu:gloo,cuda:nccl"; }
  // Overrides Backend::shutdown where it has one (libtorch_compat.h): both backends go down.
  void shutdown() {
    shutdown_backend(*cpu_);
    shutdown_backend(*cuda_);
  }

  WorkPtr broadcast(Tensors& t, const c10d::BroadcastOptions& o) override {
    return of(t)->broadcast(t, o);
  }
  WorkPtr allreduce(Tensors& t, const c10d::AllreduceOptions& o) override {
    return of(t)->allreduce(t, o);
  }
  WorkPtr allreduce_coalesced(Tensors& t, const c10d::AllreduceCoalescedOptions& o) override {
    return of(t)->allreduce_coalesced(t, o);
  }
  WorkPtr reduce(Tensors& t, const c10d::ReduceOptions& o) override { return of(t)->reduce(t, o); }
  WorkPtr allgather(TensorLists& out, Tensors& in, const c10d::AllgatherOptions& o) override {
    return of(in)->allgather(out, in, o);
  }
  WorkPtr _allgather_base(at::Tensor& out, at::Tensor& in,
                          const c10d::AllgatherOptions& o) override {
    return of(in)->_allgather_base(out, in, o);
  }
  WorkPtr allgather_coalesced(TensorLists& out, Tensors& in,
                              const c10d::AllgatherOptions& o) override {
    return of(in)->allgather_coalesced(out, in, o);
  }
  WorkPtr allgather_into_tensor_coalesced(Tensors& out, Tensors& in,
                                          const c10d::AllgatherOptions& o) override {
    return of(in)->allgather_into_tensor_coalesced(out, in, o);
  }
  WorkPtr gather(TensorLists& out, Tensors& in, const c10d::GatherOptions& o) override {
    return of(in)->gather(out, in, o);
  }
  WorkPtr scatter(Tensors& out, TensorLists& in, const c10d::ScatterOptions& o) override {
    return of(out)->scatter(out, in, o);
  }
  WorkPtr reduce_scatter(Tensors& out, TensorLists& in,
                         const c10d::ReduceScatterOptions& o) override {
    return of(out)->reduce_scatter(out, in, o);
  }
  WorkPtr _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                               const c10d::ReduceScatterOptions& o) override {
    return of(in)->_reduce_scatter_base(out, in, o);
  }
  WorkPtr reduce_scatter_tensor_coalesced(Tensors& out, Tensors& in,
                                          const c10d::ReduceScatterOptions& o) override {
    return of(in)->reduce_scatter_tensor_coalesced(out, in, o);
  }
  WorkPtr alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                        std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override {
    return of(in)->alltoall_base(out, in, out_splits, in_splits, o);
  }
  WorkPtr alltoall(Tensors& out, Tensors& in, const c10d::AllToAllOptions& o) override {
    return of(in)->alltoall(out, in, o);
  }
  WorkPtr send(Tensors& t, int dst, int tag) override { return of(t)->send(t, dst, tag); }
  WorkPtr recv(Tensors& t, int src, int tag) override { return of(t)->recv(t, src, tag); }
  WorkPtr recvAnysource(Tensors& t, int tag) override { return of(t)->recvAnysource(t, tag); }
  WorkPtr barrier(const c10d::BarrierOptions& o) override { return cpu_->barrier(o); }

 private:
  C10dGroup* of(const at::Tensor& t) const {
    return t.defined() && t.is_cuda() ? cuda_.get() : cpu_.get();
  }
  C10dGroup* of(const Tensors& ts) const {
    if (ts.empty()) return cpu_.get();
    C10dGroup* first = of(ts[0]);
    for (const at::Tensor& t : ts) {
      TORCH_CHECK(of(t) == first, "a collective on group \"cpu:gloo,cuda:nccl\" got tensors on ",
                  ts[0].device(), " and ", t.device(),
                  " in one call; pass tensors of one device type per call");
    }
    return first;
  }

  c10::intrusive_ptr<C10dGroup> cpu_;
  c10::intrusive_ptr<C10dGroup> cuda_;
};

}  // namespace

c10::intrusive_ptr<C10dGroup> make_device_routed(c10::intrusive_ptr<C10dGroup> cpu,
                                                 c10::intrusive_ptr<C10dGroup> cuda) {
  return c10::make_intrusive<DeviceRoutedBackend>(std::move(cpu), std::move(cuda));
}

}  // namespace dtrain::comm::internal
