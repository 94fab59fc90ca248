// ZeroRedundancyOptimizer's layouts: which entries of the parameters each rank holds (its local
// optimizer's tensors and groups), how a step updates them and how the updated parameters reach
// every rank (the broadcast plan), and the layout-specific parts of consolidation. One
// implementation per PartitionStrategy:
//   WholeParamLayout  whole parameters per rank: PyTorch's sorted-greedy partition, a manual
//                     params_per_rank, or the DDP buckets the overlap hook derives; optionally
//                     in one bucket view per rank (whole_layout.cc)
//   FlatLayout        every parameter a view into one flat buffer, each rank owning one aligned
//                     element range, pieces of parameters (flat_layout.cc)
//   GradShardLayout   ZeRO-2: the flat buffer in DDP's buckets, each rank owning one aligned
//                     range of every bucket and the reduced gradients of only those ranges; the
//                     updated ranges are all-gathered bucket by bucket (grad_shard_layout.cc)
// Internal to optim/. Constructing a layout may move the parameters' data (set_data) into its
// buffers. Collective where stated; not thread-safe.
//
//   std::unique_ptr<ZeroLayout> layout = std::make_unique<FlatLayout>(groups, group, /*alignment=*/16);
//   local = make(layout->local_tensors(0), ...);
//   at::Tensor loss = layout->step_and_sync(*local, closure);   // collective
#ifndef DTRAIN_OPTIM_ZERO_INTERNAL_LAYOUT_H_
#define DTRAIN_OPTIM_ZERO_INTERNAL_LAYOUT_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "comm/coalesced.h"
#include "comm/process_group.h"
#include "optim/functional/adapter.h"
#include "optim/zero/internal/state.h"
#include "partition/flat_partition.h"
#include "partition/sorted_greedy.h"

namespace dtrain::optim::internal {

using Works = std::vector<c10::intrusive_ptr<c10d::Work>>;

// Evaluates `closure` with autograd on; undefined without one.
at::Tensor evaluate_closure(const torch::optim::Optimizer::LossClosure& closure);
// Waits for every work.
void wait_all(const Works& works);
// What a broadcast or all-gather of parameters sends: comm/coalesced.h's wire_view.
using comm::wire_view;

class ZeroLayout {
 public:
  virtual ~ZeroLayout() = default;

  // Every parameter, in global order (groups concatenated).
  const std::vector<at::Tensor>& params() const { return params_; }
  // Whole parameters per rank. FlatLayout: numel_per_rank holds each rank's range size and a
  // parameter belongs to the rank holding its first element.
  const partition::ParamPartition& partition() const { return partition_; }
  // This rank's entries in local order: grouped by parameter group, groups in order.
  const std::vector<LocalEntry>& entries() const { return entries_; }
  // Parameter count of each group.
  std::vector<size_t> group_counts() const;

  // The tensors of parameter group `group` that this rank's local optimizer steps.
  virtual std::vector<at::Tensor> local_tensors(size_t group) const = 0;
  // Collective: this rank's local step (the closure evaluated there), then every rank's updated
  // entries broadcast from their owners and waited for. Returns the closure's loss.
  virtual at::Tensor step_and_sync(torch::optim::Optimizer& local,
                                   torch::optim::Optimizer::LossClosure closure) = 0;
  // Throws (c10::Error) when this layout cannot take another parameter group.
  virtual void check_can_add_group() const = 0;
  // Appends a parameter group (REQUIRES check_can_add_group): earlier groups keep their owners.
  virtual void add_group(const std::vector<at::Tensor>& params) = 0;
  // This rank's part for checkpoint::consolidate_state_dict, from its local state dict; and the
  // merged result in PyTorch's global format.
  virtual c10::IValue consolidation_part(const c10::IValue& local_state_dict) const = 0;
  virtual c10::IValue assemble_consolidated(const c10::IValue& merged) const = 0;
  // The strategy recorded in sharded checkpoints.
  virtual const char* sharded_kind() const = 0;
  // The gradients this rank steps with: every parameter's .grad (defined ones), or with sharded
  // gradients (ZeRO-2) only this rank's reduced slices, so a global norm needs a sum across ranks.
  virtual std::vector<at::Tensor> gradients() const;
  virtual bool gradients_sharded() const { return false; }
  // Bytes of gradients this rank holds for the step (of gradients()' tensors, or their buffer).
  virtual int64_t gradient_bytes() const;
  // ZeroRedundancyOptimizer::clip_grad_norm_ (its contract) over gradients(): with sharded
  // gradients the norm is reduced across the ranks (collective, on the group's device), otherwise
  // nothing is sent. The norm is accumulated and returned (0-dim) on the gradients' device, and
  // read by the host only for error_if_nonfinite.
  at::Tensor clip_grad_norm_(double max_norm, double norm_type, bool error_if_nonfinite);

 protected:
  ZeroLayout(const std::vector<std::vector<at::Tensor>>& groups, comm::Group group);
  int rank() const { return group_.rank(); }
  int world_size() const { return group_.size(); }

  comm::Group group_;
  std::vector<at::Tensor> params_;
  std::vector<std::vector<int64_t>> group_sizes_;  // numel per parameter, per group
  partition::ParamPartition partition_;
  std::vector<LocalEntry> entries_;
};

class WholeParamLayout final : public ZeroLayout {
 public:
  // `params_per_rank` empty: PyTorch's sorted-greedy partition; else that manual partition
  // (global indices per rank, one group). Errors (c10::Error): an invalid manual partition.
  WholeParamLayout(const std::vector<std::vector<at::Tensor>>& groups, comm::Group group,
                   const std::vector<std::vector<int64_t>>& params_per_rank, bool bucket_view,
                   int64_t chunk_bytes);

  std::vector<at::Tensor> local_tensors(size_t group) const override;
  // With a functional local optimizer, the step runs in chunks and each chunk's broadcasts start
  // as soon as it is updated; otherwise the local optimizer steps, then everything is broadcast.
  at::Tensor step_and_sync(torch::optim::Optimizer& local,
                           torch::optim::Optimizer::LossClosure closure) override;
  void check_can_add_group() const override {}
  void add_group(const std::vector<at::Tensor>& params) override;
  c10::IValue consolidation_part(const c10::IValue& local_state_dict) const override;
  c10::IValue assemble_consolidated(const c10::IValue& merged) const override { return merged; }
  const char* sharded_kind() const override { return "zero_whole_parameters"; }

  // Parameter `param`'s local index, -1 when another rank (or none) owns it.
  int64_t local_index(int64_t param) const {
    return global_to_local_.at(static_cast<size_t>(param));
  }
  // Whether some parameter's requires_grad differs from when the buckets were last built.
  bool trainability_changed() const;
  // Collective, in call order: starts the broadcasts of `params` (global indices, each owner's in
  // its local order) from their owners. Runs of one owner's parameters next to each other in its
  // bucket view go out as one tensor; frozen parameters outside the buckets never change and are
  // not sent. Appends the works to `works`.
  void broadcast(const std::vector<int64_t>& params, Works& works) const;

 private:
  void assign(const std::vector<std::vector<int64_t>>& params_per_rank);
  void build_buckets();
  // Per owner rank, its parameters (local order) split at parameter boundaries into the same
  // number of chunks on every rank.
  std::vector<std::vector<std::vector<int64_t>>> sync_chunks() const;
  void step_and_sync_chunked(FunctionalOptimizerAdapter& adapter);

  bool bucket_view_;
  int64_t chunk_bytes_;
  std::vector<int64_t> global_to_local_;
  std::vector<at::Tensor> buckets_;     // per rank, with bucket views
  std::vector<int64_t> bucket_offset_;  // per parameter: offset in its owner's bucket, -1 outside
  std::vector<bool> trainable_;
};

class FlatLayout final : public ZeroLayout {
 public:
  // Errors (c10::Error): flat_partition's (e.g. alignment < 1).
  FlatLayout(const std::vector<std::vector<at::Tensor>>& groups, comm::Group group,
             int64_t alignment);

  std::vector<at::Tensor> local_tensors(size_t group) const override;
  // Each piece's gradient is the matching slice of its parameter's; one broadcast per rank range.
  at::Tensor step_and_sync(torch::optim::Optimizer& local,
                           torch::optim::Optimizer::LossClosure closure) override;
  void check_can_add_group() const override;
  void add_group(const std::vector<at::Tensor>& params) override;
  // Pieces are keyed by their flat offset (unique across ranks); groups carry global indices.
  c10::IValue consolidation_part(const c10::IValue& local_state_dict) const override;
  c10::IValue assemble_consolidated(const c10::IValue& merged) const override;
  const char* sharded_kind() const override { return "zero_flat"; }

 private:
  at::Tensor buffer_;
  std::vector<int64_t> offsets_;           // per parameter: where it starts in the buffer
  std::vector<partition::Range> ranges_;   // per rank
  std::vector<int64_t> piece_offsets_;     // per entry: where it starts in the buffer
  std::vector<at::Tensor> piece_tensors_;  // per entry: its view of the buffer
};

class GradShardLayout final : public ZeroLayout {
 public:
  // `buckets`: global parameter indices per DDP bucket, in reduction order; every parameter of
  // the single group in exactly one bucket. Bucket b's parameters are laid out back to back in a
  // segment of world * chunk(b) elements (zero padding at the end); rank r owns elements
  // [r * chunk(b), (r + 1) * chunk(b)) of it, chunk(b) = ceil(numel / world) rounded up to
  // `alignment`. Errors (c10::Error): more than one group; a parameter in no bucket or in two.
  GradShardLayout(const std::vector<std::vector<at::Tensor>>& groups, comm::Group group,
                  const std::vector<std::vector<int64_t>>& buckets, int64_t alignment);

  std::vector<at::Tensor> local_tensors(size_t group) const override;
  // Per bucket: this rank's pieces stepped with their reduced gradient slices (none before the
  // first reduction), then the bucket's ranges all-gathered; every all-gather waited at the end.
  at::Tensor step_and_sync(torch::optim::Optimizer& local,
                           torch::optim::Optimizer::LossClosure closure) override;
  void check_can_add_group() const override;
  void add_group(const std::vector<at::Tensor>& params) override {
    (void)params;
    check_can_add_group();
  }
  c10::IValue consolidation_part(const c10::IValue& local_state_dict) const override;
  c10::IValue assemble_consolidated(const c10::IValue& merged) const override;
  const char* sharded_kind() const override { return "zero_grad_shards"; }
  std::vector<at::Tensor> gradients() const override;
  bool gradients_sharded() const override { return true; }

  size_t bucket_count() const { return segments_.size(); }
  // Elements of bucket b's gradients (what DDP hands the hook) and of its padded segment.
  int64_t bucket_numel(size_t b) const { return segments_.at(b).numel; }
  int64_t padded_numel(size_t b) const { return segments_.at(b).chunk * world_size(); }
  // This rank's slice of bucket b's reduced gradient: where its reduce-scatter writes.
  at::Tensor grad_chunk(size_t b) const;
  // The reduce-scatters of a backward pass completed: the slices hold gradients from now on.
  void mark_reduced() { reduced_ = true; }
  // Bytes of this rank's gradient slices, padding included.
  int64_t gradient_bytes() const override {
    return grad_shard_.numel() * grad_shard_.element_size();
  }

 private:
  struct Segment {
    int64_t numel = 0;            // the bucket's elements
    int64_t offset = 0;           // where its segment starts in param_buffer_
    int64_t chunk = 0;            // elements per rank
    int64_t shard_offset = 0;     // where this rank's chunk starts in grad_shard_
    std::vector<size_t> entries;  // this rank's entries in the bucket
  };
  std::vector<Segment> segments_;
  at::Tensor param_buffer_;             // every parameter's data, bucket segments back to back
  at::Tensor grad_shard_;               // this rank's reduced gradient chunks, bucket by bucket
  std::vector<int64_t> offsets_;        // per parameter: where it starts in param_buffer_
  std::vector<int64_t> piece_offsets_;  // per entry: where it starts in param_buffer_
  std::vector<at::Tensor> piece_tensors_, piece_grads_;  // per entry
  bool reduced_ = false;
};

}  // namespace dtrain::optim::internal

#endif  // DTRAIN_OPTIM_ZERO_INTERNAL_LAYOUT_H_
