// ZeroOptions: how a ZeroRedundancyOptimizer (optim/zero/zero_redundancy_optimizer.h) shards its
// state, each option with its default, and the checks of one option against another that the
// optimizer runs at construction.
//
//   dtrain::optim::ZeroOptions options;
//   options.group = world;                                  // required
//   options.strategy = dtrain::optim::PartitionStrategy::kFlat;
//   options.flat_alignment = 64;
//   dtrain::optim::check_zero_options(options, /*num_param_groups=*/1);  // OK: no conflict
//   options.params_per_rank = {{0}, {1}};
//   dtrain::optim::check_zero_options(options, 1);  // c10::Error: params_per_rank needs sorted_greedy
#ifndef DTRAIN_OPTIM_ZERO_OPTIONS_H_
#define DTRAIN_OPTIM_ZERO_OPTIONS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/process_group.h"

namespace dtrain::optim {

enum class PartitionStrategy {
  // PyTorch's: whole parameters, largest first, to the least-loaded rank.
  kSortedGreedy,
  // Beyond PyTorch: parameters laid out in one flat buffer, each rank owning one contiguous,
  // aligned element range (pieces of parameters). Balance within alignment of ideal whatever
  // the parameter sizes (a dominant embedding no longer leaves one rank with most state).
  kFlat,
};

struct ZeroOptions {
  // The ranks that share the state. Required (PyTorch defaults to the world group: pass it).
  comm::Group group;
  // Parameters of each rank live in one contiguous bucket (their .data() become views into it),
  // synchronised with one broadcast per rank instead of one per parameter. Off, every parameter
  // keeps its own storage. kFlat always lays every parameter out in one flat buffer (its ranges
  // cut across parameters), whatever this says.
  bool parameters_as_bucket_view = false;
  // With a functional local optimizer: target bytes per overlapped step+sync chunk (at most 8
  // chunks, split at parameter boundaries). Smaller chunks start communication earlier.
  int64_t overlap_chunk_bytes = int64_t{8} << 20;
  PartitionStrategy strategy = PartitionStrategy::kSortedGreedy;
  // kFlat: range boundaries are multiples of this many elements.
  int64_t flat_alignment = 16;
  // Manual partition (PyTorch's params_per_rank): global parameter indices per rank, one
  // parameter group only. Empty: sorted-greedy.
  std::vector<std::vector<int64_t>> params_per_rank;
  // PyTorch's overlap_with_ddp: the optimizer step runs inside DDP's communication hook, bucket
  // by bucket as the gradient all-reduces finish (ddp_hooks/zero_hook.h), and step() does
  // nothing and returns an undefined tensor; step(closure) warns and does not evaluate the
  // closure (PyTorch warns and returns None). Needs one parameter group and a functional local
  // optimizer: a torch::optim one with a functional twin (SGD, Adam, AdamW, Adagrad, RMSprop) is
  // converted, as PyTorch converts. The hook re-partitions the parameters by DDP bucket. Unlike
  // PyTorch, no warm-up iterations are lost. Changing a parameter's requires_grad afterwards is an
  // error at the next step (PyTorch raises too).
  bool overlap_with_ddp = false;
  // Beyond PyTorch: ZeRO stage 2 with DDP (ddp_hooks/zero_hook.h's hook_with_zero2): the
  // gradients are sharded too. Each DDP bucket is reduce-scattered as backward produces it, so a
  // rank keeps the averaged gradient of only its aligned range of every bucket (about 1/world of
  // the gradients; .grad of the parameters stays undefined); step() steps those ranges and
  // all-gathers the updated parameters bucket by bucket. Per iteration a rank sends 2(n-1)/n of
  // the model's bytes instead of DDP + ZeRO-1's 3(n-1)/n. clip_grad_norm_ works across the
  // shards. Needs one parameter group and a functional local optimizer (torch::optim twins are
  // converted, as with overlap_with_ddp); register the hook before the first step and before
  // loading a checkpoint. Ranges are aligned to flat_alignment elements; strategy,
  // parameters_as_bucket_view and overlap_chunk_bytes do not apply (the layout follows DDP's
  // buckets).
  bool shard_gradients = false;
};

// Throws c10::Error naming the conflict and what to do when two options cannot be combined
// (params_per_rank or overlap_with_ddp with kFlat; shard_gradients with overlap_with_ddp or
// params_per_rank), when an option that needs one parameter group (params_per_rank,
// overlap_with_ddp, shard_gradients) gets `num_param_groups` != 1, or when flat_alignment < 1.
// Does not look at `group` (the optimizer checks membership).
void check_zero_options(const ZeroOptions& options, size_t num_param_groups);

// Every option that changes which collectives the optimizer issues, as text: ranks that built
// their optimizers with different fingerprints would pair unrelated collectives.
std::string zero_options_fingerprint(const ZeroOptions& options);

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_ZERO_OPTIONS_H_
