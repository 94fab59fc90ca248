// SUM reduce-scatter of one flat tensor (PyTorch's dist.reduce_scatter_tensor), on every LibTorch
// dtrain supports: rank r ends with chunk r of the sum of every rank's input. ZeRO-2 uses it to
// reduce each rank's gradient shard with (n-1)/n of an all-reduce's traffic per rank.
//
//   // n = group.size(); every rank calls it, in the same order, with the same sizes.
//   at::Tensor grads = at::empty({n * c});    // this rank's full gradient, c elements per rank
//   at::Tensor shard = at::empty({c});        // receives chunk group.rank() of the sum
//   dtrain::comm::ReduceScatterWork w = dtrain::comm::reduce_scatter_tensor(group, shard, grads);
//   ... other work ...
//   w.wait();                                 // shard = sum over ranks of their grads[rank*c, +c)
//
// How it runs:
//   NCCL (and any backend but Gloo): the backend's _reduce_scatter_base (reduce_scatter_tensor in
//   Python).
//   Gloo, on every LibTorch version: an alltoall_base into a temporary buffer the size of the
//   input, after which wait() sums the n received chunks, in rank order, into the output. Each
//   rank sends the same (n-1)*c elements as a ring reduce-scatter; the costs are one extra
//   input-sized buffer while in flight and a local sum of n chunks at wait(). Gloo's own
//   reduce-scatter is no better: 1.13 has none (ProcessGroupGloo::reduce_scatter and
//   _reduce_scatter_base throw "does not support"), and 2.x runs _reduce_scatter_base as an
//   all-reduce of a copy of the input (2(n-1)/n of the input's bytes per rank, not (n-1)/n),
//   keeping this rank's chunk.
// A group of one rank copies input into output (no collective).
#ifndef DTRAIN_COMM_REDUCE_SCATTER_H_
#define DTRAIN_COMM_REDUCE_SCATTER_H_

#include <memory>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "comm/process_group.h"

namespace dtrain::comm {

// A SUM reduce-scatter in flight. Copies share it (a wait() through one is done for all); a
// default one is !defined() and wait() on it does nothing.
class ReduceScatterWork {
 public:
  ReduceScatterWork() = default;

  // Blocks until done; then `output` holds the sum over the group's ranks of chunk rank() of each
  // rank's input. Throws (c10::Error) as c10d::Work::wait does (timeout, dead peer); a wait() that
  // threw throws again when repeated. Idempotent once it returned: a second wait() does nothing.
  // Not thread-safe: one thread waits (on any copy).
  void wait();

  // True for a work returned by reduce_scatter_tensor.
  bool defined() const { return state_ != nullptr; }

 private:
  struct State {
    c10::intrusive_ptr<c10d::Work> work;  // null for a group of one (already copied)
    at::Tensor buffer;                    // alltoall emulation: the received chunks, [n, c]
    at::Tensor output;                    // where the emulation's wait() sums them
    bool done = false;
  };
  std::shared_ptr<State> state_;  // shared by copies; null when !defined()

  friend ReduceScatterWork reduce_scatter_tensor(const Group& group, const at::Tensor& output,
                                                 const at::Tensor& input);
};

// Starts a SUM reduce-scatter over `group`. Every rank of the group calls it, in the same order
// relative to its other collectives, with the same sizes and dtype.
// REQUIRES: group.is_member(); input contiguous with n*c elements (n = group.size(), any shape),
// output contiguous with c elements, same dtype and device as input, not overlapping input
// (TORCH_CHECK with a message naming the sizes). Both tensors must stay alive and unmodified
// until wait() returns.
ReduceScatterWork reduce_scatter_tensor(const Group& group, const at::Tensor& output,
                                        const at::Tensor& input);

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_REDUCE_SCATTER_H_
