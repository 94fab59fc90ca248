// Bucketed (coalesced) collectives: many tensors moved as a few flat buffers, the way DDP and
// ZeRO move parameters, instead of one collective per tensor.
//
//   at::Tensor flat = dtrain::comm::flatten_dense_tensors(params);        // one contiguous copy
//   std::vector<at::Tensor> views = dtrain::comm::unflatten_dense_tensors(flat, params);
//
//   // Asynchronous; buckets of <= 25 MiB per dtype, results land in `params` at wait().
//   dtrain::comm::CoalescedWork w = dtrain::comm::broadcast_coalesced(group, params, /*src=*/0);
//   ... other work ...
//   w.wait();
//
// All collectives here must be called by every rank of the group with tensors of the same
// shapes, dtypes and order. Tensors must be dense and on one device (TORCH_CHECK otherwise).
#ifndef DTRAIN_COMM_COALESCED_H_
#define DTRAIN_COMM_COALESCED_H_

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "comm/process_group.h"

namespace dtrain::comm {

constexpr int64_t kDefaultBucketCapBytes = int64_t{25} << 20;

// One 1-D tensor holding `tensors` back to back (same dtype and device required). Call it
// qualified: argument-dependent lookup also finds at::flatten_dense_tensors.
at::Tensor flatten_dense_tensors(at::TensorList tensors);

// Views into `flat` shaped like `like` (no copy). REQUIRES flat.numel() == sum of numels.
std::vector<at::Tensor> unflatten_dense_tensors(const at::Tensor& flat, at::TensorList like);

// Indices of `tensors` grouped into buckets of at most `cap_bytes` each, one dtype per bucket,
// order kept within a dtype (torch._utils._take_tensors). A tensor larger than the cap gets a
// bucket of its own.
std::vector<std::vector<size_t>> bucket_tensors(at::TensorList tensors, int64_t cap_bytes);

// Pending coalesced collective: wait() blocks until every bucket is done and the results are
// copied back into the caller's tensors; it rethrows a communication failure. Move-only.
class CoalescedWork {
 public:
  CoalescedWork() = default;
  CoalescedWork(CoalescedWork&&) = default;
  CoalescedWork& operator=(CoalescedWork&&) = default;
  ~CoalescedWork();

  void wait();
  bool is_completed() const;
  size_t num_buckets() const { return buckets_.size(); }

 private:
  struct Bucket {
    c10::intrusive_ptr<c10d::Work> work;
    std::function<void()> finish;  // copy back out of the flat buffer
  };
  std::vector<Bucket> buckets_;
  bool waited_ = false;
  friend CoalescedWork broadcast_coalesced(const Group&, const std::vector<at::Tensor>&, int,
                                           int64_t);
  friend CoalescedWork all_reduce_coalesced(const Group&, const std::vector<at::Tensor>&,
                                            c10d::ReduceOp, int64_t);
  friend CoalescedWork all_gather_coalesced(const Group&, const std::vector<at::Tensor>&,
                                            const std::vector<std::vector<at::Tensor>>&, int64_t);
};

// Broadcast `tensors` from group rank `src` into every rank's `tensors`.
CoalescedWork broadcast_coalesced(const Group& group, const std::vector<at::Tensor>& tensors,
                                  int src, int64_t bucket_cap_bytes = kDefaultBucketCapBytes);

// In-place all-reduce of `tensors` (SUM by default).
CoalescedWork all_reduce_coalesced(const Group& group, const std::vector<at::Tensor>& tensors,
                                   c10d::ReduceOp op = c10d::ReduceOp::SUM,
                                   int64_t bucket_cap_bytes = kDefaultBucketCapBytes);

// outputs[r][i] receives rank r's inputs[i]. REQUIRES outputs.size() == group.size() and each
// outputs[r] shaped like `inputs`.
CoalescedWork all_gather_coalesced(const Group& group, const std::vector<at::Tensor>& inputs,
                                   const std::vector<std::vector<at::Tensor>>& outputs,
                                   int64_t bucket_cap_bytes = kDefaultBucketCapBytes);

// What a broadcast or all-gather sends for `t`: a bfloat16 or float16 tensor as a uint8 view of
// its bytes (every backend copies bytes; Gloo in some LibTorch builds, Debian sid's 2.14, has no
// bfloat16 or float16 collectives: "Invalid scalar type"), any other tensor -- and a 2-byte float
// tensor whose last dimension is strided, which has no byte view -- as it is.
at::Tensor wire_view(const at::Tensor& t);

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_COALESCED_H_
