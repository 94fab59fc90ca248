#include "optim/zero/internal/state.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <utility>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "optim/functional/state_checks.h"

namespace dtrain::optim::internal {
namespace {

using checkpoint::OptimizerStateDict;
using checkpoint::ParamGroup;
using checkpoint::StateEntry;

bool is_state_tensor(const c10::IValue& v) { return v.isTensor() && v.toTensor().dim() > 0; }

// Whether entry `key` of parameter `p`'s state is element-wise (sliced with the parameter). A
// 0-d parameter's element-wise state is 0-d too, like its per-parameter scalars: those are
// PyTorch's "step" and NAdam's "mu_product".
bool elementwise(const std::string& key, const c10::IValue& v, const at::Tensor& p) {
  if (is_state_tensor(v)) return true;
  return v.isTensor() && p.dim() == 0 && key != "step" && key != "mu_product";
}

OptimizerStateDict parsed(const c10::IValue& state_dict, const char* what) {
  absl::StatusOr<OptimizerStateDict> sd = checkpoint::parse_optimizer_state_dict(state_dict, what);
  TORCH_CHECK(sd.ok(), sd.status().message());
  return *std::move(sd);
}

}  // namespace

std::vector<std::vector<int64_t>> all_group_params(const std::vector<size_t>& group_counts) {
  std::vector<std::vector<int64_t>> out;
  int64_t first = 0;
  for (size_t count : group_counts) {
    out.emplace_back(count);
    for (size_t i = 0; i < count; ++i) out.back()[i] = first + static_cast<int64_t>(i);
    first += static_cast<int64_t>(count);
  }
  return out;
}

c10::IValue rekeyed_state_dict(const c10::IValue& local_state_dict,
                               const std::vector<int64_t>& keys,
                               const std::vector<std::vector<int64_t>>& group_params) {
  OptimizerStateDict sd =
      parsed(local_state_dict, "consolidate_state_dict: the local optimizer's state dict");
  OptimizerStateDict out;
  for (const auto& [k, entry] : sd.state) out.state.emplace(keys.at(static_cast<size_t>(k)), entry);
  for (size_t g = 0; g < sd.param_groups.size(); ++g) {
    out.param_groups.push_back(ParamGroup{group_params.at(g), sd.param_groups[g].options});
  }
  return checkpoint::to_ivalue(out);
}

c10::IValue assemble_pieces(const c10::IValue& merged, const std::vector<int64_t>& flat_offsets,
                            const std::vector<at::Tensor>& params) {
  OptimizerStateDict in = parsed(merged, "consolidate_state_dict: the consolidated pieces");
  // Flat offset -> parameter (the last start at or before it; among parameters starting at the
  // same offset, the non-empty one), then each parameter's pieces concatenated in offset order
  // (the map's order). Parameters need not be laid out in index order (ZeRO-2's buckets).
  std::vector<std::pair<std::pair<int64_t, int64_t>, int64_t>> starts;  // ((offset, numel), param)
  for (size_t i = 0; i < flat_offsets.size(); ++i) {
    starts.push_back({{flat_offsets[i], params[i].numel()}, static_cast<int64_t>(i)});
  }
  std::sort(starts.begin(), starts.end());
  std::map<int64_t, std::vector<StateEntry>> by_param;
  for (const auto& [offset, entry] : in.state) {
    auto it = std::upper_bound(starts.begin(), starts.end(),
                               std::make_pair(std::make_pair(offset, INT64_MAX), INT64_MAX));
    TORCH_CHECK(it != starts.begin(), "consolidate_state_dict: a piece at flat offset ", offset,
                " before every parameter");
    by_param[std::prev(it)->second].push_back(entry);
  }
  OptimizerStateDict out;
  for (auto& [param, list] : by_param) {
    StateEntry entry = checkpoint::new_state_entry();
    for (const auto& kv : list.front()) {
      if (!is_state_tensor(kv.value())) {
        entry.insert(kv.key(), kv.value());
        continue;
      }
      const at::Tensor& p = params[static_cast<size_t>(param)];
      if (list.size() == 1 && kv.value().toTensor().numel() != p.numel()) {
        // A whole parameter's own state of another shape (Adafactor's factored variances).
        entry.insert(kv.key(), kv.value());
        continue;
      }
      std::vector<at::Tensor> parts;
      for (const StateEntry& piece : list)
        parts.push_back(piece.at(kv.key()).toTensor().reshape(-1));
      entry.insert(kv.key(), at::cat(parts).view(p.sizes()));
    }
    out.state.emplace(param, entry);
  }
  out.param_groups = std::move(in.param_groups);
  return checkpoint::to_ivalue(out);
}

IndexedState local_state_from_global(const IndexedState& state,
                                     const std::vector<LocalEntry>& entries,
                                     const std::vector<at::Tensor>& params) {
  // The global format does not depend on the partition: pick this rank's parameters by index
  // (slices: the elements of them this rank holds).
  IndexedState local_state;
  for (size_t k = 0; k < entries.size(); ++k) {
    const LocalEntry& e = entries[k];
    auto found = state.find(e.param);
    if (found == state.end()) continue;
    if (!e.slice) {
      local_state.emplace(static_cast<int64_t>(k), found->second);
      continue;
    }
    StateEntry entry = checkpoint::new_state_entry();
    for (const auto& kv : found->second) {
      const c10::IValue& v = kv.value();
      if (!is_state_tensor(v)) {
        entry.insert(kv.key(), v);
        continue;
      }
      // The same check (and words) as the functional optimizers' load: a state tensor of another
      // shape would be cut into this rank's slice and scramble the state.
      const at::Tensor& p = params[static_cast<size_t>(e.param)];
      TORCH_CHECK(v.toTensor().sizes() == p.sizes(), "load_state_dict: state '",
                  kv.key().toStringRef(), "' of parameter ", e.param, " has shape ",
                  v.toTensor().sizes(), ", the parameter has shape ", p.sizes());
      entry.insert(kv.key(),
                   v.toTensor().reshape(-1).narrow(0, e.range.begin, e.range.size()).clone());
    }
    local_state.emplace(static_cast<int64_t>(k), entry);
  }
  return local_state;
}

std::vector<ParamGroup> local_param_groups(const std::vector<ParamGroup>& groups,
                                           const std::vector<LocalEntry>& entries,
                                           const std::vector<size_t>& group_counts) {
  TORCH_CHECK(groups.size() == group_counts.size(), "load_state_dict: the state dict has ",
              groups.size(), " parameter groups, this optimizer has ", group_counts.size());
  std::vector<size_t> local_counts(group_counts.size(), 0);
  for (const LocalEntry& e : entries) ++local_counts.at(e.group);
  std::vector<ParamGroup> local_groups;
  int64_t next = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    TORCH_CHECK(groups[g].params.size() == group_counts[g], "load_state_dict: group ", g, " has ",
                groups[g].params.size(), " parameters in the state dict and ", group_counts[g],
                " here");
    ParamGroup local{{}, groups[g].options};
    for (size_t k = 0; k < local_counts[g]; ++k) local.params.push_back(next++);
    local_groups.push_back(std::move(local));
  }
  return local_groups;
}

absl::StatusOr<CheckedGlobal> checked_global_state(const OptimizerStateDict& sd,
                                                   const std::vector<at::Tensor>& params,
                                                   const std::vector<size_t>& group_counts,
                                                   const EntryCheck& check,
                                                   const std::string& what) {
  if (sd.param_groups.size() != group_counts.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the state dict has ", sd.param_groups.size(),
        " parameter groups, this optimizer has ", group_counts.size(), "; ", kLoadAdvice));
  }
  for (size_t g = 0; g < group_counts.size(); ++g) {
    if (sd.param_groups[g].params.size() != group_counts[g]) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": param_groups[", g, "] has ", sd.param_groups[g].params.size(),
          " parameters in the state dict and ", group_counts[g], " here; ", kLoadAdvice));
    }
    absl::Status numbers = check_option_numbers(sd.param_groups[g], g, what);
    if (!numbers.ok()) return numbers;
  }
  absl::Status indices = check_param_indices(sd, params.size(), what);
  if (!indices.ok()) return indices;
  CheckedGlobal out;
  out.groups = sd.param_groups;
  std::vector<size_t> group_of;
  std::map<int64_t, int64_t> position_of;  // file index -> parameter index here
  for (size_t g = 0; g < sd.param_groups.size(); ++g) {
    for (int64_t file : sd.param_groups[g].params) {
      position_of[file] = static_cast<int64_t>(out.file_index.size());
      out.file_index.push_back(file);
      group_of.push_back(g);
    }
  }
  for (const auto& [file, entry] : sd.state) out.state.emplace(position_of.at(file), entry);
  for (const auto& [i, entry] : out.state) {
    const auto k = static_cast<size_t>(i);
    absl::Status ok = check(group_of[k], entry, params[k], out.file_index[k],
                            sd.param_groups[group_of[k]].options);
    if (!ok.ok()) return ok;
  }
  return out;
}

std::map<int64_t, partition::Range> owned_ranges(const std::vector<LocalEntry>& entries) {
  std::map<int64_t, partition::Range> out;
  for (const LocalEntry& e : entries) {
    if (e.range.size() > 0) out[e.param] = e.range;
  }
  return out;
}

checkpoint::ShardedState sharded_from_local(const c10::IValue& local_state_dict,
                                            const std::vector<LocalEntry>& entries,
                                            const std::vector<at::Tensor>& params,
                                            const std::vector<size_t>& group_counts) {
  OptimizerStateDict sd =
      parsed(local_state_dict, "sharded_state: the local optimizer's state dict");
  checkpoint::ShardedState out;
  for (const auto& [k, state] : sd.state) {
    const LocalEntry& e = entries.at(static_cast<size_t>(k));
    const at::Tensor& p = params[static_cast<size_t>(e.param)];
    checkpoint::ShardedState::Param entry;
    entry.shape = p.sizes().vec();
    entry.range = e.range;
    const bool whole = e.range.begin == 0 && e.range.end == p.numel();
    for (const auto& s : state) {
      const c10::IValue& v = s.value();
      // The sharded format: a whole parameter's state is full-shaped, a slice's is 1-D.
      if (is_state_tensor(v) && whole && v.toTensor().numel() != p.numel()) {
        entry.entries.insert(s.key(), v);  // its own shape (Adafactor's factored variances)
      } else if (is_state_tensor(v)) {
        entry.entries.insert(s.key(),
                             whole ? v.toTensor().reshape(p.sizes()) : v.toTensor().reshape(-1));
      } else {
        entry.entries.insert(s.key(), v);
      }
    }
    out.params[e.param] = std::move(entry);
  }
  const std::vector<std::vector<int64_t>> global = all_group_params(group_counts);
  std::vector<ParamGroup> groups;
  for (size_t g = 0; g < sd.param_groups.size(); ++g)
    groups.push_back(ParamGroup{global.at(g), sd.param_groups[g].options});
  out.param_groups = checkpoint::param_groups_to_ivalue(groups);
  return out;
}

IndexedState local_state_from_sharded(const checkpoint::ShardedState& state,
                                      const std::vector<LocalEntry>& entries,
                                      const std::vector<at::Tensor>& params, int rank) {
  IndexedState local_state;
  for (size_t k = 0; k < entries.size(); ++k) {
    const LocalEntry& e = entries[k];
    const partition::Range& range = e.range;
    auto it = state.params.find(e.param);
    if (it == state.params.end()) continue;  // no state for it yet (never stepped)
    const checkpoint::ShardedState::Param& saved = it->second;
    const at::Tensor& p = params[static_cast<size_t>(e.param)];
    TORCH_CHECK(saved.range.begin == range.begin && saved.range.end == range.end,
                "load_sharded_state: parameter ", e.param, " holds elements [", saved.range.begin,
                ", ", saved.range.end, ") in the given state, but rank ", rank, " owns [",
                range.begin, ", ", range.end, "); ask checkpoint::load_sharded for owned_ranges()");
    TORCH_CHECK(c10::IntArrayRef(saved.shape).equals(p.sizes()), "load_sharded_state: parameter ",
                e.param, " has shape ", c10::IntArrayRef(saved.shape), " in the given state but ",
                p.sizes(), " here");
    StateEntry entry = checkpoint::new_state_entry();
    for (const auto& s : saved.entries) {
      const c10::IValue& v = s.value();
      if (!elementwise(s.key().toStringRef(), v, p)) {
        entry.insert(s.key(), v);
        continue;
      }
      const at::Tensor t = v.toTensor();
      if (!e.slice && t.numel() != p.numel()) {
        // A whole parameter's own state of another shape (Adafactor's factored variances): as
        // it is; the local optimizer's load checks its shape.
        entry.insert(s.key(), v);
        continue;
      }
      TORCH_CHECK(t.numel() == range.size(), "load_sharded_state: entry '", s.key().toStringRef(),
                  "' of parameter ", e.param, " has ", t.numel(), " elements for a range of ",
                  range.size());
      entry.insert(s.key(), e.slice ? t.reshape(-1) : t.reshape(p.sizes()));
    }
    local_state.emplace(static_cast<int64_t>(k), entry);
  }
  return local_state;
}

absl::Status check_sharded_info(const checkpoint::ShardedInfo& info, const std::string& dir,
                                const std::vector<at::Tensor>& params,
                                const std::vector<size_t>& group_counts) {
  // The saved parameters are the ones that had state; each must be one of ours, shaped the same.
  for (const auto& [param, shape] : info.shapes) {
    if (param < 0 || param >= static_cast<int64_t>(params.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ZeRO checkpoint ", dir, " has state for parameter ", param, " but this optimizer has ",
          params.size(), " parameters; load it into the same model"));
    }
    const at::Tensor& p = params[static_cast<size_t>(param)];
    if (!c10::IntArrayRef(shape).equals(p.sizes())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ZeRO checkpoint ", dir, ": parameter ", param, " has shape [",
          absl::StrJoin(shape, ", "), "] there but [", absl::StrJoin(p.sizes(), ", "), "] here"));
    }
  }
  absl::StatusOr<std::vector<ParamGroup>> groups = checkpoint::parse_param_groups(
      info.param_groups, absl::StrCat("ZeRO checkpoint ", dir, ": its param groups"));
  if (!groups.ok()) return absl::InvalidArgumentError(groups.status().message());
  if (groups->size() != group_counts.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ZeRO checkpoint ", dir, " has ", groups->size(),
                                                   " parameter groups, this optimizer has ",
                                                   group_counts.size()));
  }
  for (size_t g = 0; g < group_counts.size(); ++g) {
    if ((*groups)[g].params.size() != group_counts[g]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ZeRO checkpoint ", dir, ": parameter group ", g, " has ", (*groups)[g].params.size(),
          " parameters there, ", group_counts[g], " here; load it into the same model"));
    }
  }
  return absl::OkStatus();
}

}  // namespace dtrain::optim::internal
