#include "comm/reduce_scatter.h"

#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include "comm/libtorch_compat.h"

namespace dtrain::comm {

void ReduceScatterWork::wait() {
  if (state_ == nullptr || state_->done) return;
  State& s = *state_;
  if (s.work) s.work->wait();  // rethrows a failure; done stays false so a repeat throws too
  if (s.buffer.defined()) {
    // Chunk j of the buffer came from rank j; sum in rank order (deterministic, like a ring).
    s.output.copy_(s.buffer[0]);
    for (int64_t j = 1; j < s.buffer.size(0); ++j) s.output.add_(s.buffer[j]);
    s.buffer = at::Tensor();  // free the temporary now rather than with the work
  }
  s.done = true;
}

ReduceScatterWork reduce_scatter_tensor(const Group& group, const at::Tensor& output,
                                        const at::Tensor& input) {
  const int n = group.size();  // TORCH_CHECKs membership
  TORCH_CHECK(input.defined() && output.defined(),
              "reduce_scatter_tensor: input and output must be defined tensors");
  TORCH_CHECK(input.is_contiguous() && output.is_contiguous(),
              "reduce_scatter_tensor: input and output must be contiguous (call .contiguous() or "
              "flatten into a fresh buffer first)");
  TORCH_CHECK(output.numel() * n == input.numel(), "reduce_scatter_tensor: input has ",
              input.numel(), " elements and output ", output.numel(), ", but a group of ", n,
              " ranks needs input = ", n, " x output elements (here ", output.numel() * n,
              "); size the input as group.size() chunks of the output's size");
  TORCH_CHECK(input.scalar_type() == output.scalar_type(), "reduce_scatter_tensor: input is ",
              input.scalar_type(), " but output is ", output.scalar_type(), "; use one dtype");
  TORCH_CHECK(input.device() == output.device(), "reduce_scatter_tensor: input is on ",
              input.device(), " but output is on ", output.device(), "; use one device");
  TORCH_CHECK(at::get_overlap_status(input, output) == at::MemOverlapStatus::No,
              "reduce_scatter_tensor: output (", output.numel(), " elements) overlaps input (",
              input.numel(),
              " elements); reduce into a separate buffer and copy if the shard must live in the "
              "input");

  ReduceScatterWork w;
  w.state_ = std::make_shared<ReduceScatterWork::State>();
  ReduceScatterWork::State& s = *w.state_;
  if (n == 1) {
    output.view({-1}).copy_(input.view({-1}));
    s.done = true;
    return w;
  }
  at::Tensor in = input.view({-1});
  at::Tensor out = output.view({-1});
  // Gloo: none in 1.13, an all-reduce underneath in 2.x (comm/libtorch_compat.h); the
  // all-to-all below sends half of that, on both versions.
  const bool native = group.backend() != "gloo";
  if (native) {
    s.work = group.pg()->_reduce_scatter_base(out, in);  // ReduceScatterOptions: SUM
    return w;
  }
  // alltoall_base with equal splits: chunk j of this rank's input goes to rank j, and chunk j of
  // the buffer arrives from rank j.
  at::Tensor buffer = at::empty_like(in);
  std::vector<int64_t> equal_splits;  // empty: n equal chunks along dim 0
  s.work = group.pg()->alltoall_base(buffer, in, equal_splits, equal_splits);
  s.buffer = buffer.view({n, out.numel()});
  s.output = out;
  return w;
}

}  // namespace dtrain::comm
