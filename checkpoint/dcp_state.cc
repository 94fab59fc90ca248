#include "checkpoint/dcp_state.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dtrain::checkpoint {
namespace {

using Box = std::pair<std::vector<int64_t>, std::vector<int64_t>>;

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Boxes of [begin, end) in the tensor shape[dim:], each prefixed by `prefix` (the indices of the
// dimensions before dim, each of size 1).
void boxes_from(const std::vector<int64_t>& shape, size_t dim, int64_t begin, int64_t end,
                std::vector<int64_t> prefix, std::vector<Box>* out) {
  if (begin >= end) return;
  const size_t rest = shape.size() - dim;
  auto box = [&](int64_t first_row, int64_t rows) {
    Box b;
    b.first = prefix;
    b.first.push_back(first_row);
    b.second.assign(prefix.size(), 1);
    b.second.push_back(rows);
    for (size_t d = dim + 1; d < shape.size(); ++d) {
      b.first.push_back(0);
      b.second.push_back(shape[d]);
    }
    out->push_back(std::move(b));
  };
  if (rest == 1) {
    box(begin, end - begin);
    return;
  }
  int64_t inner = 1;
  for (size_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t r0 = begin / inner;
  const int64_t r1 = end / inner;
  auto within_row = [&](int64_t row, int64_t b, int64_t e) {
    std::vector<int64_t> p = prefix;
    p.push_back(row);
    boxes_from(shape, dim + 1, b, e, std::move(p), out);
  };
  if (r0 == r1) {  // inside one row
    within_row(r0, begin - r0 * inner, end - r0 * inner);
    return;
  }
  int64_t full = r0;
  if (begin % inner != 0) {
    within_row(r0, begin % inner, inner);
    full = r0 + 1;
  }
  if (r1 > full) box(full, r1 - full);
  if (end % inner != 0) within_row(r1, 0, end % inner);
}

std::string state_key(const DcpStateLayout& l, const std::string& fqn, const std::string& name) {
  return absl::StrCat(l.optim_key, ".state.", fqn, ".", name);
}

DcpPath state_path(const DcpStateLayout& l, const std::string& fqn, const std::string& name) {
  if (l.flatten_optimizer_state_dict) return {l.optim_key, absl::StrCat("state.", fqn, ".", name)};
  return {l.optim_key, std::string("state"), fqn, name};
}

absl::Status bad_entry(int64_t index, const std::string& fqn, const std::string& name,
                       const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("dcp_optimizer_items: parameter ", index, " (",
                                                 fqn, ") state '", name, "': ", what));
}

// One parameter's entries as items.
absl::Status param_items(int64_t index, const std::string& fqn, const ShardedState::Param& p,
                         const DcpStateLayout& l, std::vector<DcpWriteItem>* out) {
  const int64_t numel = numel_of(p.shape);
  const bool whole = p.range.begin == 0 && p.range.end == numel;
  const bool first = p.range.begin == 0;  // writes the parameter's own (non-sliced) entries
  for (const auto& kv : p.entries) {
    const std::string name = kv.key().toStringRef();
    const std::string key = state_key(l, fqn, name);
    DcpPath path = state_path(l, fqn, name);
    const c10::IValue& v = kv.value();
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (whole && t.dim() > 0) {
        // Element-wise state, or a parameter's own of another shape (Adafactor's row and
        // column variances): whole, from the one rank holding the parameter.
        out->push_back(DcpWriteItem::whole(key, t, std::move(path)));
      } else if (!whole && t.dim() == 1 && t.numel() == p.range.size() && name != "step") {
        int64_t at_elem = 0;
        for (auto& [offsets, sizes] : flat_range_boxes(p.shape, p.range)) {
          const int64_t n = numel_of(sizes);
          out->push_back(DcpWriteItem::chunk(key, p.shape, offsets,
                                             t.narrow(0, at_elem, n).reshape(sizes), path));
          at_elem += n;
        }
      } else if (t.dim() == 0 || (whole && t.numel() == 1)) {
        if (first) out->push_back(DcpWriteItem::whole(key, t, std::move(path)));
      } else {
        return bad_entry(
            index, fqn, name,
            absl::StrCat("a tensor of size [", absl::StrJoin(t.sizes(), ", "), "] for elements [",
                         p.range.begin, ", ", p.range.end, ") of a parameter of size [",
                         absl::StrJoin(p.shape, ", "), "]"));
      }
    } else if (name == "step" && (v.isInt() || v.isDouble())) {
      // PyTorch keeps step as a float32 0-d tensor; its dcp.load expects one there.
      if (first) {
        out->push_back(DcpWriteItem::whole(
            key,
            at::scalar_tensor(v.isInt() ? static_cast<double>(v.toInt()) : v.toDouble(),
                              at::kFloat),
            std::move(path)));
      }
    } else if (v.isInt() || v.isDouble() || v.isBool() || v.isNone() || v.isString()) {
      if (first) out->push_back(DcpWriteItem::object(key, v, std::move(path)));
    } else {
      return bad_entry(index, fqn, name,
                       absl::StrCat("a ", v.tagKind(), ", which DCP state does not hold"));
    }
  }
  return absl::OkStatus();
}

absl::Status group_items(const ShardedState& state, const std::vector<std::string>& fqns,
                         const DcpStateLayout& l, std::vector<DcpWriteItem>* out) {
  if (state.param_groups.isNone()) return absl::OkStatus();
  absl::StatusOr<std::vector<ParamGroup>> groups =
      parse_param_groups(state.param_groups, "dcp_optimizer_items: the param groups");
  if (!groups.ok()) return groups.status();
  for (size_t g = 0; g < groups->size(); ++g) {
    const ParamGroup& group = (*groups)[g];
    c10::impl::GenericList names(c10::StringType::get());
    for (int64_t i : group.params) {
      if (i < 0 || i >= static_cast<int64_t>(fqns.size())) {
        return absl::InvalidArgumentError(absl::StrCat("dcp_optimizer_items: param group ", g,
                                                       " lists parameter ", i, ", but fqns names ",
                                                       fqns.size()));
      }
      names.push_back(fqns[static_cast<size_t>(i)]);
    }
    if (l.flatten_optimizer_state_dict) {
      for (int64_t i : group.params) {
        for (const auto& kv : group.options) {
          const std::string rest = absl::StrCat("param_groups.", fqns[static_cast<size_t>(i)], ".",
                                                kv.key().toStringRef());
          out->push_back(DcpWriteItem::object(absl::StrCat(l.optim_key, ".", rest), kv.value(),
                                              {l.optim_key, rest}));
        }
      }
      continue;
    }
    const int64_t gi = static_cast<int64_t>(g);
    for (const auto& kv : group.options) {
      const std::string name = kv.key().toStringRef();
      out->push_back(DcpWriteItem::object(absl::StrCat(l.optim_key, ".param_groups.", g, ".", name),
                                          kv.value(),
                                          {l.optim_key, std::string("param_groups"), gi, name}));
    }
    out->push_back(DcpWriteItem::object(
        absl::StrCat(l.optim_key, ".param_groups.", g, ".params"), names,
        {l.optim_key, std::string("param_groups"), gi, std::string("params")}));
  }
  return absl::OkStatus();
}

// The options of group keys under `prefix` ("optim.param_groups.0."), in the order they were
// written (file, offset): PyTorch's order for files either side wrote.
c10::impl::GenericDict options_under(const DcpReader& r, const std::string& prefix,
                                     absl::Status* error) {
  std::vector<std::tuple<std::string, int64_t, std::string>> found;
  for (const auto& [key, s] : r.metadata().objects) {
    if (!absl::StartsWith(key, prefix)) continue;
    const std::string name = key.substr(prefix.size());
    if (name == "params" || name.find('.') != std::string::npos) continue;
    found.emplace_back(s.relative_path, s.offset, name);
  }
  std::sort(found.begin(), found.end());
  c10::impl::GenericDict options = new_state_entry();
  for (const auto& [file, offset, name] : found) {
    absl::StatusOr<c10::IValue> v = r.value(prefix + name);
    if (!v.ok()) {
      *error = v.status();
      break;
    }
    options.insert(name, *v);
  }
  return options;
}

absl::StatusOr<std::vector<ParamGroup>> read_groups(const DcpReader& r,
                                                    const std::vector<std::string>& fqns,
                                                    const DcpStateLayout& l) {
  std::map<std::string, int64_t> index_of;
  for (size_t i = 0; i < fqns.size(); ++i) index_of[fqns[i]] = static_cast<int64_t>(i);
  std::vector<ParamGroup> groups;
  absl::Status error;
  for (int g = 0;; ++g) {  // nested: optim.param_groups.<g>.params
    const std::string prefix = absl::StrCat(l.optim_key, ".param_groups.", g, ".");
    if (r.metadata().objects.count(prefix + "params") == 0) break;
    absl::StatusOr<c10::IValue> params = r.value(prefix + "params");
    if (!params.ok()) return params.status();
    if (!params->isList())
      return absl::DataLossError(absl::StrCat(r.dir(), ": ", prefix, "params is not a list"));
    ParamGroup group;
    for (const c10::IValue& name : params->toListRef()) {
      auto it = name.isString() ? index_of.find(name.toStringRef()) : index_of.end();
      if (it == index_of.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "DCP checkpoint ", r.dir(), ": param group ", g, " lists parameter '",
            name.isString() ? name.toStringRef() : "?", "', which this model does not have"));
      }
      group.params.push_back(it->second);
    }
    group.options = options_under(r, prefix, &error);
    if (!error.ok()) return error;
    groups.push_back(std::move(group));
  }
  if (!groups.empty()) return groups;
  // flatten_optimizer_state_dict: options per parameter; parameters with equal options that
  // follow each other make one group.
  for (size_t i = 0; i < fqns.size(); ++i) {
    c10::impl::GenericDict options =
        options_under(r, absl::StrCat(l.optim_key, ".param_groups.", fqns[i], "."), &error);
    if (!error.ok()) return error;
    if (options.size() == 0) continue;
    bool same = !groups.empty() && groups.back().options.size() == options.size();
    for (const auto& kv : options) {
      if (!same) break;
      auto it = groups.back().options.find(kv.key());
      same = it != groups.back().options.end() && it->value() == kv.value();
    }
    if (!same) groups.push_back(ParamGroup{{}, options});
    groups.back().params.push_back(static_cast<int64_t>(i));
  }
  return groups;
}

// 8-bit optimizer state (optim/functional/state_precision.h; checkpoint does not depend on optim):
// a slot is "<slot>_codes" (uint8, the parameter's shape) and "<slot>_absmax" (float32, one per
// block of 256 elements of the flattened parameter), meaningful only together and whole.
bool is_8bit_state(const std::string& name) {
  return absl::EndsWith(name, "_codes") || absl::EndsWith(name, "_absmax");
}

// InvalidArgument for 8-bit state `key` wanted as elements [range) of parameter `fqn`, not whole.
absl::Status cut_8bit_state(const DcpReader& r, const std::string& key, const std::string& fqn,
                            partition::Range range) {
  return absl::InvalidArgumentError(absl::StrCat(
      "DCP checkpoint ", r.dir(), " holds 8-bit optimizer state ('", key,
      "': codes and scales of blocks of 256 elements of the whole parameter), which cannot be cut "
      "into elements [",
      range.begin, ", ", range.end, ") of ", fqn,
      "; load it into whole parameters (ZeRO's sorted_greedy partition without shard_gradients, or "
      "no ZeRO), and save it with state_dtype bfloat16 or None for an element-range partition"));
}

}  // namespace

std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, partition::Range range) {
  std::vector<Box> out;
  if (shape.empty()) {
    if (range.begin == 0 && range.end == 1) out.push_back({{}, {}});
    return out;
  }
  boxes_from(shape, 0, range.begin, range.end, {}, &out);
  return out;
}

std::vector<DcpWriteItem> dcp_model_items(
    const std::vector<std::pair<std::string, at::Tensor>>& named, const DcpStateLayout& layout) {
  std::vector<DcpWriteItem> out;
  for (const auto& [name, t] : named)
    out.push_back(DcpWriteItem::whole(absl::StrCat(layout.model_key, ".", name), t,
                                      {layout.model_key, name}));
  return out;
}

absl::StatusOr<std::vector<DcpWriteItem>> dcp_optimizer_items(const ShardedState& state,
                                                              const std::vector<std::string>& fqns,
                                                              bool with_param_groups,
                                                              const DcpStateLayout& layout) {
  std::vector<DcpWriteItem> out;
  for (const auto& [index, p] : state.params) {
    if (index < 0 || index >= static_cast<int64_t>(fqns.size())) {
      return absl::InvalidArgumentError(absl::StrCat("dcp_optimizer_items: parameter ", index,
                                                     " has state, but fqns names ", fqns.size()));
    }
    if (absl::Status s = param_items(index, fqns[static_cast<size_t>(index)], p, layout, &out);
        !s.ok())
      return s;
  }
  if (with_param_groups) {
    if (absl::Status s = group_items(state, fqns, layout, &out); !s.ok()) return s;
  }
  return out;
}

ShardedState whole_sharded_state(const OptimizerStateDict& state_dict,
                                 const std::vector<std::vector<int64_t>>& shapes) {
  ShardedState out;
  for (const auto& [index, entry] : state_dict.state) {
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(shapes.size()),
                "whole_sharded_state: state for parameter ", index, " of ", shapes.size());
    ShardedState::Param p;
    p.shape = shapes[static_cast<size_t>(index)];
    p.range = {0, numel_of(p.shape)};
    p.entries = entry;
    out.params[index] = std::move(p);
  }
  out.param_groups = param_groups_to_ivalue(state_dict.param_groups);
  return out;
}

absl::StatusOr<c10::impl::GenericDict> load_dcp_model(const DcpReader& reader,
                                                      const std::vector<std::string>& names,
                                                      const DcpStateLayout& layout) {
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  for (const std::string& name : names) {
    absl::StatusOr<at::Tensor> t = reader.tensor(absl::StrCat(layout.model_key, ".", name));
    if (!t.ok()) return t.status();
    out.insert(name, *t);
  }
  return out;
}

absl::StatusOr<ShardedState> load_dcp_optimizer(const DcpReader& reader,
                                                const std::vector<std::string>& fqns,
                                                const std::map<int64_t, partition::Range>& wanted,
                                                const std::vector<std::vector<int64_t>>& shapes,
                                                const DcpStateLayout& layout) {
  ShardedState out;
  absl::StatusOr<std::vector<ParamGroup>> groups = read_groups(reader, fqns, layout);
  if (!groups.ok()) return groups.status();
  out.param_groups = param_groups_to_ivalue(*groups);
  for (const auto& [index, range] : wanted) {
    if (index < 0 || index >= static_cast<int64_t>(fqns.size()) ||
        static_cast<size_t>(index) >= shapes.size()) {
      return absl::InvalidArgumentError(absl::StrCat("load_dcp_optimizer: parameter ", index,
                                                     " is wanted, but fqns names ", fqns.size()));
    }
    const std::string& fqn = fqns[static_cast<size_t>(index)];
    ShardedState::Param p;
    p.shape = shapes[static_cast<size_t>(index)];
    p.range = range;
    const bool whole = range.begin == 0 && range.end == numel_of(p.shape);
    const std::string prefix = absl::StrCat(layout.optim_key, ".state.", fqn, ".");
    for (auto it = reader.metadata().tensors.lower_bound(prefix);
         it != reader.metadata().tensors.end() && absl::StartsWith(it->first, prefix); ++it) {
      const std::string name = it->first.substr(prefix.size());
      if (name.find('.') != std::string::npos) continue;
      if (!whole && is_8bit_state(name)) return cut_8bit_state(reader, it->first, fqn, range);
      absl::StatusOr<at::Tensor> t;
      if (it->second.size != p.shape || whole || p.shape.empty()) {
        t = reader.tensor(it->first);  // whole, or the parameter's own ("step")
      } else {
        std::vector<at::Tensor> parts;
        for (const auto& [offsets, sizes] : flat_range_boxes(p.shape, range)) {
          absl::StatusOr<at::Tensor> part = reader.tensor(it->first, offsets, sizes);
          if (!part.ok()) return part.status();
          parts.push_back(part->reshape({-1}));
        }
        t = parts.empty() ? at::empty({0}, at::TensorOptions().dtype(it->second.dtype))
                          : at::cat(parts);
      }
      if (!t.ok()) return t.status();
      p.entries.insert(name, *t);
    }
    for (auto it = reader.metadata().objects.lower_bound(prefix);
         it != reader.metadata().objects.end() && absl::StartsWith(it->first, prefix); ++it) {
      const std::string name = it->first.substr(prefix.size());
      if (name.find('.') != std::string::npos) continue;
      absl::StatusOr<c10::IValue> v = reader.value(it->first);
      if (!v.ok()) return v.status();
      p.entries.insert(name, *v);
    }
    if (p.entries.size() > 0) out.params[index] = std::move(p);
  }
  return out;
}

}  // namespace dtrain::checkpoint
