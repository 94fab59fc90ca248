#include "checkpoint/optimizer_state_dict.h"

#include <set>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace dtrain::checkpoint {
namespace {

constexpr char kParams[] = "params";

absl::Status bad(const std::string& what, const std::string& part) {
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", part));
}

// The value of `key` in a dict of string (or Any) keys, or nullptr.
const c10::IValue* find(const c10::impl::GenericDict& d, const char* key) {
  auto it = d.find(c10::IValue(std::string(key)));
  return it == d.end() ? nullptr : &it->value();
}

absl::StatusOr<ParamGroup> parse_group(const c10::IValue& v, size_t g, const std::string& what) {
  if (!v.isGenericDict()) return bad(what, absl::StrCat("param group ", g, " is not a dict"));
  ParamGroup group;
  bool has_params = false;
  for (const auto& kv : v.toGenericDict()) {
    if (!kv.key().isString())
      return bad(what, absl::StrCat("param group ", g, " has a key that is not a string"));
    if (kv.key().toStringRef() != kParams) {
      group.options.insert(kv.key(), kv.value());
      continue;
    }
    has_params = true;
    if (!kv.value().isList())
      return bad(what, absl::StrCat("param group ", g, "'s 'params' is not a list"));
    for (const c10::IValue& p : kv.value().toListRef()) {
      if (!p.isInt())
        return bad(what, absl::StrCat("param group ", g, "'s 'params' holds a non-integer"));
      group.params.push_back(p.toInt());
    }
  }
  if (!has_params) return bad(what, absl::StrCat("param group ", g, " has no 'params'"));
  return group;
}

}  // namespace

StateEntry new_state_entry() { return StateEntry(c10::StringType::get(), c10::AnyType::get()); }

absl::StatusOr<std::vector<ParamGroup>> parse_param_groups(const c10::IValue& groups,
                                                           const std::string& what) {
  if (!groups.isList()) return bad(what, absl::StrCat("'", kParamGroupsKey, "' is not a list"));
  std::vector<ParamGroup> out;
  const auto list = groups.toListRef();
  for (size_t g = 0; g < list.size(); ++g) {
    absl::StatusOr<ParamGroup> group = parse_group(list[g], g, what);
    if (!group.ok()) return group.status();
    out.push_back(*std::move(group));
  }
  return out;
}

absl::StatusOr<OptimizerStateDict> parse_optimizer_state_dict(const c10::IValue& state_dict,
                                                              const std::string& what) {
  if (!state_dict.isGenericDict()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not a dict (got ", state_dict.tagKind(), ")"));
  }
  const c10::impl::GenericDict sd = state_dict.toGenericDict();
  const c10::IValue* state = find(sd, kStateKey);
  const c10::IValue* groups = find(sd, kParamGroupsKey);
  if (state == nullptr || groups == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " needs keys '", kStateKey, "' and '", kParamGroupsKey, "'"));
  }
  OptimizerStateDict out;
  if (!state->isGenericDict()) return bad(what, absl::StrCat("'", kStateKey, "' is not a dict"));
  for (const auto& kv : state->toGenericDict()) {
    if (!kv.key().isInt()) return bad(what, "state keys must be integer parameter indices");
    const int64_t index = kv.key().toInt();
    if (!kv.value().isGenericDict())
      return bad(what, absl::StrCat("state[", index, "] is not a dict"));
    for (const auto& e : kv.value().toGenericDict()) {
      if (!e.key().isString())
        return bad(what, absl::StrCat("state[", index, "] has a key that is not a string"));
    }
    out.state.emplace(index, kv.value().toGenericDict());
  }
  absl::StatusOr<std::vector<ParamGroup>> parsed = parse_param_groups(*groups, what);
  if (!parsed.ok()) return parsed.status();
  out.param_groups = *std::move(parsed);
  return out;
}

c10::IValue param_groups_to_ivalue(const std::vector<ParamGroup>& groups) {
  c10::impl::GenericList out(c10::AnyType::get());
  for (const ParamGroup& g : groups) {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    for (const auto& kv : g.options) d.insert(kv.key(), kv.value());
    d.insert(kParams, c10::List<int64_t>(g.params));
    out.push_back(d);
  }
  return out;
}

c10::IValue to_ivalue(const OptimizerStateDict& state_dict) {
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  for (const auto& [index, entry] : state_dict.state) state.insert(index, entry);
  c10::impl::GenericDict sd(c10::StringType::get(), c10::AnyType::get());
  sd.insert(kStateKey, state);
  sd.insert(kParamGroupsKey, param_groups_to_ivalue(state_dict.param_groups));
  return sd;
}

OptimizerStateDict reindexed(const OptimizerStateDict& state_dict,
                             const std::vector<int64_t>& new_index) {
  auto map = [&](int64_t i) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(new_index.size()), "reindexed: parameter index ",
                i, " is outside the ", new_index.size(), " new indices");
    return new_index[static_cast<size_t>(i)];
  };
  OptimizerStateDict out;
  for (const auto& [index, entry] : state_dict.state) out.state.emplace(map(index), entry);
  for (const ParamGroup& g : state_dict.param_groups) {
    ParamGroup copy{{}, g.options};
    for (int64_t p : g.params) copy.params.push_back(map(p));
    out.param_groups.push_back(std::move(copy));
  }
  return out;
}

OptimizerStateDict group_slice(const OptimizerStateDict& state_dict, size_t group) {
  TORCH_CHECK(group < state_dict.param_groups.size(), "group_slice: group ", group,
              " out of range (", state_dict.param_groups.size(), " groups)");
  const ParamGroup& g = state_dict.param_groups[group];
  OptimizerStateDict out;
  ParamGroup local{{}, g.options};
  for (size_t i = 0; i < g.params.size(); ++i) {
    local.params.push_back(static_cast<int64_t>(i));
    auto it = state_dict.state.find(g.params[i]);
    if (it != state_dict.state.end()) out.state.emplace(static_cast<int64_t>(i), it->second);
  }
  out.param_groups.push_back(std::move(local));
  return out;
}

OptimizerStateDict concatenate(const std::vector<OptimizerStateDict>& parts) {
  OptimizerStateDict out;
  int64_t offset = 0;
  for (const OptimizerStateDict& part : parts) {
    for (const auto& [index, entry] : part.state) out.state.emplace(index + offset, entry);
    int64_t count = 0;
    for (const ParamGroup& g : part.param_groups) {
      ParamGroup shifted{{}, g.options};
      for (int64_t p : g.params) shifted.params.push_back(p + offset);
      count += static_cast<int64_t>(g.params.size());
      out.param_groups.push_back(std::move(shifted));
    }
    offset += count;
  }
  return out;
}

absl::StatusOr<OptimizerStateDict> merge(const std::vector<OptimizerStateDict>& parts,
                                         size_t options_from) {
  if (options_from >= parts.size()) {
    return absl::InvalidArgumentError(absl::StrCat("merge: options_from=", options_from,
                                                   " but there are ", parts.size(), " parts"));
  }
  const size_t num_groups = parts[options_from].param_groups.size();
  OptimizerStateDict out;
  std::map<int64_t, size_t> holder;
  for (size_t k = 0; k < parts.size(); ++k) {
    if (parts[k].param_groups.size() != num_groups) {
      return absl::InvalidArgumentError(
          absl::StrCat("merge: part ", k, " has ", parts[k].param_groups.size(),
                       " param groups, part ", options_from, " has ", num_groups));
    }
    for (const auto& [index, entry] : parts[k].state) {
      auto [it, inserted] = holder.emplace(index, k);
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(
            "merge: state of parameter ", index, " is in both part ", it->second, " and part ", k));
      }
      out.state.emplace(index, entry);
    }
  }
  for (size_t g = 0; g < num_groups; ++g) {
    std::set<int64_t> params;
    for (const OptimizerStateDict& part : parts)
      params.insert(part.param_groups[g].params.begin(), part.param_groups[g].params.end());
    out.param_groups.push_back(ParamGroup{std::vector<int64_t>(params.begin(), params.end()),
                                          parts[options_from].param_groups[g].options});
  }
  return out;
}

int64_t state_tensor_bytes(const OptimizerStateDict& state_dict) {
  int64_t bytes = 0;
  for (const auto& [index, entry] : state_dict.state) {
    for (const auto& e : entry) {
      if (e.value().isTensor()) bytes += static_cast<int64_t>(e.value().toTensor().nbytes());
    }
  }
  return bytes;
}

}  // namespace dtrain::checkpoint
