#include "partition/flat_partition.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dtrain::partition {

absl::StatusOr<FlatPartition> flat_partition(int64_t total_numel, int world_size,
                                             int64_t alignment) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size must be at least 1, got ", world_size));
  }
  if (total_numel < 0) {
    return absl::InvalidArgumentError(absl::StrCat("total_numel must be >= 0, got ", total_numel));
  }
  if (alignment < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("alignment must be at least 1 element, got ", alignment));
  }
  FlatPartition fp;
  fp.total_numel = total_numel;
  fp.alignment = alignment;
  const int64_t ideal = (total_numel + world_size - 1) / world_size;
  const int64_t chunk = (ideal + alignment - 1) / alignment * alignment;
  fp.ranges.reserve(world_size);
  for (int64_t r = 0; r < world_size; ++r) {
    fp.ranges.push_back(
        Range{std::min(r * chunk, total_numel), std::min((r + 1) * chunk, total_numel)});
  }
  return fp;
}

namespace {

// Appends to `out` the pieces of parameters p, p + 1, ... that overlap `range`, parameter p
// starting at flat offset `start`.
void append_slices(const std::vector<int64_t>& numels, Range range, int64_t p, int64_t start,
                   std::vector<ParamSlice>* out) {
  for (; p < static_cast<int64_t>(numels.size()) && start < range.end; start += numels[p++]) {
    const int64_t lo = std::max(range.begin, start);
    const int64_t hi = std::min(range.end, start + numels[p]);
    if (hi > lo) out->push_back(ParamSlice{p, lo - start, hi - start, lo});
  }
}

}  // namespace

absl::StatusOr<FlatPartition> flat_partition(const std::vector<int64_t>& param_numels,
                                             int world_size, int64_t alignment) {
  int64_t total = 0;
  for (size_t i = 0; i < param_numels.size(); ++i) {
    if (param_numels[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", i, " has negative size ", param_numels[i]));
    }
    total += param_numels[i];
  }
  absl::StatusOr<FlatPartition> fp = flat_partition(total, world_size, alignment);
  if (!fp.ok()) return fp;
  // One pass over parameters and ranges together: O(P + W).
  fp->slices.assign(world_size, {});
  int64_t param = 0;
  int64_t param_start = 0;
  for (int r = 0; r < world_size; ++r) {
    const Range range = fp->ranges[r];
    while (param < static_cast<int64_t>(param_numels.size()) &&
           param_start + param_numels[param] <= range.begin) {
      param_start += param_numels[param++];
    }
    append_slices(param_numels, range, param, param_start, &fp->slices[r]);
  }
  return fp;
}

std::vector<ParamSlice> slices_in_range(const std::vector<int64_t>& param_numels, Range range) {
  std::vector<ParamSlice> out;
  append_slices(param_numels, range, 0, 0, &out);
  return out;
}

}  // namespace dtrain::partition
