// Element-granular partition of a flattened parameter buffer (beyond PyTorch's ZeRO, which only
// assigns whole parameters): rank r owns one contiguous range of elements, ranges aligned to
// `alignment` elements, so the largest shard is at most ideal + alignment.
//
//   std::vector<int64_t> numels = {1000, 10, 3};        // parameters, flattened in this order
//   absl::StatusOr<FlatPartition> fp = flat_partition(numels, /*world_size=*/4, /*alignment=*/16);
//   for (const ParamSlice& s : fp->slices[rank]) {
//     // elements [s.begin, s.end) of parameter s.param_index live at
//     // flat offset s.flat_offset of the buffer (s.flat_offset - fp->ranges[rank].begin in the shard)
//   }
#ifndef DTRAIN_PARTITION_FLAT_PARTITION_H_
#define DTRAIN_PARTITION_FLAT_PARTITION_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace dtrain::partition {

// Half-open element range [begin, end): of the flat buffer here; of one flattened (row-major)
// parameter in checkpoint/sharded.h and ZeRO's state pieces.
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const Range& o) const { return begin == o.begin && end == o.end; }
};

// Elements [begin, end) of parameter param_index (offsets within the flattened parameter), stored
// at flat_offset in the flat buffer.
struct ParamSlice {
  int64_t param_index = 0;
  int64_t begin = 0;
  int64_t end = 0;
  int64_t flat_offset = 0;
  int64_t size() const { return end - begin; }
};

struct FlatPartition {
  int64_t total_numel = 0;
  int64_t alignment = 1;
  // ranges[rank]: the rank's contiguous range; ranges tile [0, total_numel) in rank order (trailing
  // ranks may be empty when the buffer is small).
  std::vector<Range> ranges;
  // slices[rank]: the parameter pieces inside ranges[rank], in flat order (only when built from
  // parameter sizes).
  std::vector<std::vector<ParamSlice>> slices;
};

// Ranges of ceil(total / world_size) rounded up to `alignment` elements each.
// InvalidArgument when world_size < 1, total_numel < 0 or alignment < 1.
absl::StatusOr<FlatPartition> flat_partition(int64_t total_numel, int world_size,
                                             int64_t alignment = 1);

// The same over parameters flattened in order, with each rank's parameter slices.
absl::StatusOr<FlatPartition> flat_partition(const std::vector<int64_t>& param_numels,
                                             int world_size, int64_t alignment = 1);

// The pieces of parameters (flattened in order, sizes `param_numels`) that overlap `range`: what
// FlatPartition::slices holds for a rank's range, for any range (e.g. to map a range of another
// partition onto parameters).
std::vector<ParamSlice> slices_in_range(const std::vector<int64_t>& param_numels, Range range);

}  // namespace dtrain::partition

#endif  // DTRAIN_PARTITION_FLAT_PARTITION_H_
