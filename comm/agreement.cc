#include "comm/agreement.h"

#include <algorithm>
#include <cstdint>

#include <ATen/core/ivalue.h>
#include <ATen/ops/full.h>

#include "absl/strings/str_cat.h"
#include "comm/object_collectives.h"

namespace dtrain::comm {

absl::Status check_identical(const Group& group, const std::vector<std::string>& items,
                             std::string_view label) {
  c10::impl::GenericList mine(c10::StringType::get());
  for (const std::string& item : items) mine.push_back(item);
  absl::StatusOr<std::vector<c10::IValue>> all = all_gather_object(group, mine);
  if (!all.ok()) return all.status();
  const auto reference = (*all)[0].toList();
  for (size_t r = 1; r < all->size(); ++r) {
    const auto theirs = (*all)[r].toList();
    for (size_t i = 0; i < std::max(reference.size(), theirs.size()); ++i) {
      const std::string a = i < reference.size() ? reference.get(i).toStringRef() : "(none)";
      const std::string b = i < theirs.size() ? theirs.get(i).toStringRef() : "(none)";
      if (a != b) {
        return absl::InvalidArgumentError(absl::StrCat(std::string(label), " ", i, " is ", b,
                                                       " on rank ", r, " but ", a, " on rank 0"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status share_verdict(const Group& group, const absl::Status& verdict, int root) {
  c10::impl::GenericList v(c10::AnyType::get());
  v.push_back(static_cast<int64_t>(verdict.code()));
  v.push_back(std::string(verdict.message()));
  c10::IValue obj(v);
  if (absl::Status s = broadcast_object(group, obj, root); !s.ok()) return s;
  const auto got = obj.toList();
  return absl::Status(static_cast<absl::StatusCode>(got.get(0).toInt()), got.get(1).toStringRef());
}

absl::Status first_failure(const Group& group, const absl::Status& mine) {
  // The lowest failed rank, or the group's size when none failed.
  std::vector<at::Tensor> lowest = {
      at::full({1}, mine.ok() ? group.size() : group.rank(),
               at::TensorOptions().dtype(at::kInt).device(group.device()))};
  c10d::AllreduceOptions min;
  min.reduceOp = c10d::ReduceOp::MIN;
  try {
    group->allreduce(lowest, min)->wait();
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("agreeing whether every rank succeeded failed: ", e.what()));
  }
  if (!mine.ok()) return mine;
  const int failed = lowest[0].item<int>();
  if (failed < group.size()) return absl::AbortedError(absl::StrCat("rank ", failed, " failed"));
  return absl::OkStatus();
}

}  // namespace dtrain::comm
