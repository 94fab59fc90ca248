#include "optim/zero/options.h"

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace dtrain::optim {

void check_zero_options(const ZeroOptions& options, size_t num_param_groups) {
  const bool flat = options.strategy == PartitionStrategy::kFlat;
  if (!options.params_per_rank.empty()) {
    TORCH_CHECK(
        !flat,
        "`params_per_rank` is a manual whole-parameter partition: use it with the sorted_greedy "
        "strategy, not kFlat");
    TORCH_CHECK(num_param_groups == 1,
                "Specifying `params_per_rank` only supports a single parameter group");
  }
  if (options.overlap_with_ddp) {
    TORCH_CHECK(!flat,
                "overlap_with_ddp partitions whole parameters by DDP bucket: use the sorted_greedy "
                "strategy, "
                "not kFlat");
    TORCH_CHECK(num_param_groups == 1, "overlap_with_ddp supports a single parameter group, got ",
                num_param_groups);
  }
  if (options.shard_gradients) {
    TORCH_CHECK(!options.overlap_with_ddp,
                "shard_gradients and overlap_with_ddp are two ways of running ZeRO with "
                "DDP: choose one (ZeRO-2's hook is hook_with_zero2, ZeRO-1's hook_with_zero_step)");
    TORCH_CHECK(options.params_per_rank.empty(),
                "shard_gradients partitions every DDP bucket by element ranges: "
                "leave params_per_rank empty");
    TORCH_CHECK(num_param_groups == 1, "shard_gradients supports a single parameter group, got ",
                num_param_groups);
  }
  TORCH_CHECK(options.flat_alignment >= 1, "flat_alignment must be at least 1 element, got ",
              options.flat_alignment);
}

std::string zero_options_fingerprint(const ZeroOptions& options) {
  std::string out = absl::StrCat(
      "strategy=", static_cast<int>(options.strategy), " alignment=", options.flat_alignment,
      " bucket_view=", options.parameters_as_bucket_view, " overlap=", options.overlap_with_ddp,
      " shard_gradients=", options.shard_gradients, " chunk_bytes=", options.overlap_chunk_bytes,
      " params_per_rank=");
  for (const auto& ranks : options.params_per_rank) {
    for (int64_t index : ranks) absl::StrAppend(&out, index, ",");
    absl::StrAppend(&out, ";");
  }
  return out;
}

}  // namespace dtrain::optim
