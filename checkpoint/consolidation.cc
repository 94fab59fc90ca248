#include "checkpoint/consolidation.h"

#include <algorithm>
#include <map>
#include <set>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "comm/object_collectives.h"

namespace dtrain::checkpoint {
namespace {

constexpr int kTag = 0x5ca1ab;

absl::Status malformed(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("consolidate_state_dict: ", what));
}

// What a rank holds, as small IValues: one entry per (index, key) with either the value itself
// (non-tensors) or the tensor's dtype and shape (its data follows point to point).
struct Description {
  c10::impl::GenericList entries{c10::AnyType::get()};  // (index, key, value | (dtype, shape))
  std::vector<at::Tensor> tensors;                       // data to send, in entry order
};

absl::StatusOr<Description> describe(const c10::impl::GenericDict& state) {
  Description d;
  // Sorted by index so the target merges in order.
  std::vector<std::pair<int64_t, c10::IValue>> items;
  for (const auto& kv : state) {
    if (!kv.key().isInt()) return malformed("state keys must be integer parameter indices");
    if (!kv.value().isGenericDict()) return malformed(absl::StrCat("state[", kv.key().toInt(), "] is not a dict"));
    items.emplace_back(kv.key().toInt(), kv.value());
  }
  std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [index, value] : items) {
    for (const auto& kv : value.toGenericDict()) {
      const c10::IValue& v = kv.value();
      if (v.isTensor()) {
        const at::Tensor& t = v.toTensor();
        d.entries.push_back(c10::ivalue::Tuple::create(
            {index, kv.key(), true, static_cast<int64_t>(t.scalar_type()), c10::List<int64_t>(t.sizes().vec())}));
        d.tensors.push_back(t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous());
      } else {
        d.entries.push_back(c10::ivalue::Tuple::create({index, kv.key(), false, v, c10::IValue()}));
      }
    }
  }
  return d;
}

}  // namespace

absl::StatusOr<c10::IValue> consolidate_state_dict(const comm::Group& group, const c10::IValue& local_state_dict,
                                                   int to, const ConsolidateOptions& options) {
  if (!group.is_member()) {
    return absl::FailedPreconditionError("consolidate_state_dict: this rank is not a member of the group");
  }
  if (to < 0 || to >= group.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("consolidate_state_dict: to=", to, " is not a rank of this group of ", group.size()));
  }
  if (options.chunk_bytes < 1) return malformed("chunk_bytes must be positive");
  if (!local_state_dict.isGenericDict()) return malformed("the local state dict is not a dict");
  auto sd = local_state_dict.toGenericDict();
  if (!sd.contains("state") || !sd.contains("param_groups")) {
    return malformed("the local state dict needs 'state' and 'param_groups'");
  }
  absl::StatusOr<Description> desc = describe(sd.at("state").toGenericDict());
  if (!desc.ok()) return desc.status();

  // 1. Descriptions (small, pickled) to the target.
  c10::impl::GenericList mine(c10::AnyType::get());
  mine.push_back(desc->entries);
  mine.push_back(sd.at("param_groups"));
  absl::StatusOr<std::vector<c10::IValue>> all = comm::gather_object(group, mine, to);
  if (!all.ok()) return all.status();

  const bool target = group.rank() == to;
  const int n = group.size();
  // 2. The target checks the descriptions and tells every rank before any data moves, so a bad
  // input fails on all ranks at once instead of leaving senders blocked.
  c10::IValue verdict{std::string()};
  if (target) {
    std::map<int64_t, int> holder;
    const size_t num_groups = (*all)[to].toList().get(1).toList().size();
    for (int r = 0; r < n && verdict.toStringRef().empty(); ++r) {
      auto parts = (*all)[r].toList();
      if (parts.get(1).toList().size() != num_groups) {
        verdict = absl::StrCat("rank ", r, " has ", parts.get(1).toList().size(), " param groups, rank ", to,
                               " has ", num_groups, "; every rank must pass the same groups");
        break;
      }
      std::set<int64_t> seen_here;
      const auto entries = parts.get(0).toList();
      for (size_t k = 0; k < entries.size(); ++k) {
        const int64_t index = entries.get(k).toTupleRef().elements()[0].toInt();
        if (!seen_here.insert(index).second) continue;
        auto [it, inserted] = holder.emplace(index, r);
        if (!inserted) {
          verdict = absl::StrCat("state of parameter ", index, " is held by both rank ", it->second, " and rank ", r,
                                 "; each parameter's state must live on one rank");
          break;
        }
      }
    }
  }
  if (absl::Status s = comm::broadcast_object(group, verdict, to); !s.ok()) return s;
  if (!verdict.toStringRef().empty()) return malformed(verdict.toStringRef());

  auto chunks = [&](const at::Tensor& t, const std::function<void(at::Tensor)>& f) {
    at::Tensor flat = t.reshape(-1);
    const int64_t per = std::max<int64_t>(1, options.chunk_bytes / std::max<int64_t>(1, t.element_size()));
    for (int64_t b = 0; b < flat.numel(); b += per) f(flat.narrow(0, b, std::min(per, flat.numel() - b)));
  };
  try {
    if (!target) {
      // 3a. Send this rank's tensors in order, chunk by chunk, straight from their storage.
      for (const at::Tensor& t : desc->tensors) {
        chunks(t, [&](at::Tensor piece) {
          std::vector<at::Tensor> v = {piece};
          group->send(v, to, kTag)->wait();
        });
      }
      return c10::IValue();
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("consolidate_state_dict: sending to rank ", to, ": ", e.what()));
  }

  // 3b. Target: allocate every final tensor, then receive into it (all ranks concurrently).
  std::map<int64_t, c10::impl::GenericDict> merged;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  try {
    for (int r = 0; r < n; ++r) {
      auto entries = (*all)[r].toList().get(0).toList();
      size_t next_local = 0;
      for (size_t e = 0; e < entries.size(); ++e) {
        auto tup = entries.get(e).toTupleRef().elements();
        const int64_t index = tup[0].toInt();
        auto it = merged.find(index);
        if (it == merged.end()) {
          it = merged.emplace(index, c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get())).first;
        }
        c10::impl::GenericDict& entry = it->second;
        if (!tup[2].toBool()) {
          entry.insert(tup[1], tup[3]);
          continue;
        }
        at::Tensor t;
        if (r == to) {
          t = desc->tensors[next_local++];  // our own: no copy
        } else {
          t = at::empty(tup[4].toIntVector(), at::TensorOptions().dtype(static_cast<at::ScalarType>(tup[3].toInt())));
          chunks(t, [&](at::Tensor piece) {
            std::vector<at::Tensor> v = {piece};
            works.push_back(group->recv(v, r, kTag));
          });
        }
        entry.insert(tup[1], t);
      }
    }
    for (auto& w : works) w->wait();
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("consolidate_state_dict: receiving on rank ", to, ": ", e.what()));
  }

  // 4. Param groups: options from the target, params the sorted union.
  auto my_groups = (*all)[to].toList().get(1).toList();
  c10::impl::GenericList groups(c10::AnyType::get());
  for (size_t g = 0; g < my_groups.size(); ++g) {
    std::set<int64_t> params;
    for (int r = 0; r < n; ++r) {
      auto theirs = (*all)[r].toList().get(1).toList();
      auto group_dict = theirs.get(g).toGenericDict();
      if (group_dict.contains("params")) {
        for (int64_t p : group_dict.at("params").toIntVector()) params.insert(p);
      }
    }
    auto out = my_groups.get(g).toGenericDict().copy();
    out.insert_or_assign("params", c10::List<int64_t>(std::vector<int64_t>(params.begin(), params.end())));
    groups.push_back(out);
  }
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  for (auto& [index, entry] : merged) state.insert(index, entry);
  c10::impl::GenericDict result(c10::StringType::get(), c10::AnyType::get());
  result.insert("state", state);
  result.insert("param_groups", groups);
  return c10::IValue(result);
}

}  // namespace dtrain::checkpoint
