// A loaded PowerSGD state against the model's buckets (powersgd_hook.h's check_state_dict), and
// those buckets as DistributedDataParallel builds them.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "ddp_hooks/internal/powersgd_plan.h"
#include "ddp_hooks/powersgd_hook.h"

namespace dtrain::ddp_hooks {

std::vector<PowerSGDBucket> powersgd_buckets(const DistributedDataParallel& ddp,
                                             std::optional<at::ScalarType> hook_dtype) {
  const std::vector<at::Tensor>& params = ddp.parameters();
  std::vector<PowerSGDBucket> out;
  for (const std::vector<size_t>& indices : ddp.bucket_indices()) {
    PowerSGDBucket bucket;
    for (size_t i : indices) bucket.shapes.push_back(params.at(i).sizes().vec());
    bucket.dtype = hook_dtype.value_or(params.at(indices.at(0)).scalar_type());
    out.push_back(std::move(bucket));
  }
  return out;
}

namespace internal {
namespace {

constexpr const char* kAnotherModel =
    "; the checkpoint was written for another model, bucket layout (bucket_cap_mb), precision or "
    "PowerSGD settings, or edited: resume with the settings it was written with, or start "
    "without its hook state";

absl::Status misfit(const std::string& what) {
  return absl::DataLossError(absl::StrCat(what, kAnotherModel));
}

std::string shape(int64_t n, int64_t m) { return absl::StrCat(n, "x", m); }

// Memory `key` of bucket `b`: `numel` numbers of `dtype` (`what` says which).
absl::Status fits(const std::map<int64_t, at::Tensor>& dict, const char* key, int64_t b,
                  int64_t numel, at::ScalarType dtype, const std::string& what) {
  auto it = dict.find(b);
  if (it == dict.end()) return absl::OkStatus();
  const at::Tensor& t = it->second;
  if (t.numel() == numel && t.scalar_type() == dtype) return absl::OkStatus();
  return misfit(absl::StrCat("'", key, "'[", b, "] holds ", t.numel(), " ",
                             c10::toString(t.scalar_type()), " numbers, but bucket ", b,
                             " of this model needs ", numel, " ", c10::toString(dtype), " (", what,
                             ")"));
}

// With orthogonalization_epsilon 0 the next step divides each Q column by its norm after taking
// out the columns before it (Gram-Schmidt, as PyTorch's hook): a column that comes out as zeros
// (a column of zeros; its norm underflowing) makes NaN that reaches every rank's gradients. The
// same orthogonalisation, on a copy: its columns must come out of norm 1.
absl::Status orthogonalisable(const at::Tensor& memory, const PowerSGDPlan& plan, int64_t b,
                              const std::vector<std::vector<int64_t>>& shapes) {
  at::Tensor q = memory.clone();
  int64_t offset = 0;
  for (const PowerSGDPlan::Batch& batch : plan.batches) {
    const int64_t count = static_cast<int64_t>(batch.members.size());
    at::Tensor view =
        q.narrow(0, offset, count * batch.m * batch.r).view({count, batch.m, batch.r});
    const int64_t start = offset;
    offset += count * batch.m * batch.r;
    orthogonalize(view, 0);
    const at::Tensor norms = at::norm(view.to(at::kDouble), 2, {1});  // count x r
    const at::Tensor bad = at::logical_not(at::isfinite(norms)).logical_or(norms < 0.5);
    if (!bad.any().item<bool>()) continue;
    const at::Tensor first = at::nonzero(bad)[0];
    const int64_t j = first[0].item<int64_t>(), column = first[1].item<int64_t>();
    return absl::DataLossError(absl::StrCat(
        "'q_memory_dict'[", b, "]: column ", column, " of the Q of gradient ", batch.members[j],
        " (", absl::StrJoin(shapes[batch.members[j]], "x"), ", its numbers ",
        start + j * batch.m * batch.r, " to ", start + (j + 1) * batch.m * batch.r - 1,
        ") orthogonalises to zeros: the next step divides by its norm "
        "(orthogonalization_epsilon is 0) and trains NaN, as PyTorch's hook would; expected the "
        "Q memory of a finite run: start without this hook state"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status check_memories(const PowerSGDState& s, int64_t iter,
                            const std::map<int64_t, at::Tensor>& error,
                            const std::map<int64_t, at::Tensor>& p_memory,
                            const std::map<int64_t, at::Tensor>& q_memory,
                            const std::vector<PowerSGDBucket>& buckets) {
  const int64_t count = static_cast<int64_t>(buckets.size());
  const bool compressed = iter > s.start_powerSGD_iter;
  struct Memory {
    const char* key;
    const std::map<int64_t, at::Tensor>& dict;
    bool kept;  // by every bucket once the hook has compressed
  };
  for (const Memory& m : {Memory{"error_dict", error, s.use_error_feedback},
                          Memory{"p_memory_dict", p_memory, s.warm_start},
                          Memory{"q_memory_dict", q_memory, s.warm_start}}) {
    if (!m.dict.empty() && m.dict.rbegin()->first >= count) {
      return misfit(absl::StrCat(
          "'", m.key, "'[", m.dict.rbegin()->first, "] is for bucket ", m.dict.rbegin()->first,
          ", which this model does not have (it has ", count, " buckets, 0 to ", count - 1, ")"));
    }
    for (int64_t b = 0; compressed && m.kept && b < count; ++b) {
      if (m.dict.count(b) > 0) continue;
      return misfit(absl::StrCat("'", m.key, "' has no entry for bucket ", b, ", which the hook ",
                                 "keeps for every bucket from its first compressed iteration on ",
                                 "('iter' is ", iter, ", start_powerSGD_iter ",
                                 s.start_powerSGD_iter, ")"));
    }
  }
  for (int64_t b = 0; b < count; ++b) {
    const PowerSGDBucket& bucket = buckets[static_cast<size_t>(b)];
    const PowerSGDPlan plan = plan_bucket(bucket.shapes, s);
    std::vector<std::string> matrices;
    for (const PowerSGDPlan::Batch& batch : plan.batches)
      matrices.push_back(batch.members.size() == 1
                             ? shape(batch.n, batch.m)
                             : absl::StrCat(batch.members.size(), " of ", shape(batch.n, batch.m)));
    const std::string compressed_ones =
        absl::StrCat(matrices.empty() ? "none" : absl::StrJoin(matrices, ", "), " at rank ",
                     s.matrix_approximation_rank);
    for (const absl::Status& st :
         {fits(error, "error_dict", b, plan.numel, bucket.dtype, "the bucket's length"),
          fits(p_memory, "p_memory_dict", b, plan.ps_size, bucket.dtype,
               absl::StrCat("n r per compressed n x m matrix: ", compressed_ones)),
          fits(q_memory, "q_memory_dict", b, plan.qs_size, bucket.dtype,
               absl::StrCat("m r per compressed n x m matrix: ", compressed_ones))}) {
      if (!st.ok()) return st;
    }
    auto q = q_memory.find(b);
    if (s.orthogonalization_epsilon == 0 && q != q_memory.end()) {
      if (absl::Status st = orthogonalisable(q->second, plan, b, bucket.shapes); !st.ok())
        return st;
    }
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace dtrain::ddp_hooks
