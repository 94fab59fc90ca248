#include "checkpoint/sharded.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <numeric>
#include <optional>
#include <random>

#include <ATen/ATen.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/state_file.h"
#include "comm/object_collectives.h"

namespace dtrain::checkpoint {
namespace {

using Dict = c10::impl::GenericDict;

constexpr char kMetadata[] = "metadata.pt";
constexpr char kFormat[] = "dtrain-sharded v1";

Dict str_dict() { return Dict(c10::StringType::get(), c10::AnyType::get()); }
Dict int_dict() { return Dict(c10::IntType::get(), c10::AnyType::get()); }

int64_t numel_of(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

absl::Status check_param(int64_t index, const ShardedState::Param& p) {
  const int64_t numel = numel_of(p.shape);
  if (p.range.begin < 0 || p.range.end > numel || p.range.begin > p.range.end) {
    return absl::InvalidArgumentError(absl::StrCat("parameter ", index, ": range [", p.range.begin, ", ", p.range.end,
                                                   ") does not fit its ", numel, " elements"));
  }
  for (const auto& kv : p.entries) {
    if (!kv.value().isTensor()) continue;
    const at::Tensor& t = kv.value().toTensor();
    if (t.numel() != p.range.size() && !(t.dim() == 0 && numel == 1)) {
      // 0-dim tensors (PyTorch's float "step") are per parameter, not per element.
      if (t.dim() != 0) {
        return absl::InvalidArgumentError(absl::StrCat("parameter ", index, ": state '", kv.key().toStringRef(),
                                                       "' has ", t.numel(), " elements for a range of ",
                                                       p.range.size()));
      }
    }
  }
  return absl::OkStatus();
}

std::string shard_name(const std::string& id, int rank) { return absl::StrCat("shard-", id, "-", rank, ".pt"); }

// A list of ints as the file holds it: typed (List[int]) or not (List[Any], as from Python or
// dtrain's own writer); nullopt for anything else.
std::optional<std::vector<int64_t>> int_list(const c10::IValue& v) {
  if (!v.isList()) return std::nullopt;
  std::vector<int64_t> out;
  for (const c10::IValue& e : v.toListRef()) {
    if (!e.isInt()) return std::nullopt;
    out.push_back(e.toInt());
  }
  return out;
}

}  // namespace

absl::Status save_sharded(const comm::Group& group, const std::string& dir, const ShardedState& mine,
                          const std::string& strategy) {
  if (!group.is_member()) return absl::FailedPreconditionError("save_sharded: this rank is not in the group");
  // 1. One id for this save, from rank 0.
  c10::IValue id{std::string()};
  if (group.rank() == 0) id = absl::StrFormat("%016x", std::random_device{}() * 4294967296ULL + std::random_device{}());
  if (absl::Status s = comm::broadcast_object(group, id, 0); !s.ok()) return s;

  // 2. This rank's shard, in parallel with the others.
  absl::Status written = absl::OkStatus();
  Dict description = int_dict();  // index -> (begin, end, shape)
  Dict params = int_dict();
  for (const auto& [index, p] : mine.params) {
    if (written = check_param(index, p); !written.ok()) break;
    Dict entry = str_dict();
    entry.insert("range", c10::List<int64_t>({p.range.begin, p.range.end}));
    entry.insert("shape", c10::List<int64_t>(p.shape));
    entry.insert("entries", p.entries);
    params.insert(index, entry);
    description.insert(index, c10::ivalue::Tuple::create({p.range.begin, p.range.end, c10::List<int64_t>(p.shape)}));
  }
  if (written.ok()) {
    Dict shard = str_dict();
    shard.insert("format", std::string(kFormat));
    shard.insert("params", params);
    written = save_state(absl::StrCat(dir, "/", shard_name(id.toStringRef(), group.rank())), shard);
  }

  // 3. Rank 0 collects every rank's outcome and description, commits, and tells everyone.
  c10::impl::GenericList report(c10::AnyType::get());
  report.push_back(written.ok() ? std::string() : absl::StrCat("rank ", group.rank(), ": ", written.ToString()));
  report.push_back(description);
  absl::StatusOr<std::vector<c10::IValue>> reports = comm::gather_object(group, report, 0);
  if (!reports.ok()) return reports.status();
  c10::IValue verdict{std::string()};
  if (group.rank() == 0) {
    c10::impl::GenericList shards(c10::AnyType::get());
    Dict shapes = int_dict();
    for (int r = 0; r < group.size() && verdict.toStringRef().empty(); ++r) {
      auto rep = (*reports)[r].toList();
      if (!rep.get(0).toStringRef().empty()) {
        verdict = rep.get(0).toStringRef();
        break;
      }
      Dict ranges = int_dict();
      for (const auto& kv : rep.get(1).toGenericDict()) {
        auto t = kv.value().toTupleRef().elements();
        ranges.insert(kv.key(), c10::List<int64_t>({t[0].toInt(), t[1].toInt()}));
        shapes.insert_or_assign(kv.key(), t[2]);
      }
      Dict shard = str_dict();
      shard.insert("file", shard_name(id.toStringRef(), r));
      shard.insert("ranges", ranges);
      shards.push_back(shard);
    }
    if (verdict.toStringRef().empty()) {
      Dict meta = str_dict();
      meta.insert("format", std::string(kFormat));
      meta.insert("save_id", id);
      meta.insert("world_size", static_cast<int64_t>(group.size()));
      meta.insert("strategy", strategy);
      meta.insert("shards", shards);
      meta.insert("shapes", shapes);
      meta.insert("param_groups", mine.param_groups);
      meta.insert("extra", mine.extra);
      // The commit: until this rename the directory's previous checkpoint stays the valid one.
      if (absl::Status s = save_state(absl::StrCat(dir, "/", kMetadata), meta); !s.ok()) {
        verdict = absl::StrCat("rank 0 writing ", kMetadata, ": ", s.ToString());
      }
    }
    if (verdict.toStringRef().empty()) {
      // Shards of earlier saves are garbage now.
      if (DIR* d = ::opendir(dir.c_str())) {
        const std::string keep = absl::StrCat("shard-", id.toStringRef(), "-");
        while (dirent* e = ::readdir(d)) {
          const std::string name = e->d_name;
          if (absl::StartsWith(name, "shard-") && !absl::StartsWith(name, keep)) ::unlink((dir + "/" + name).c_str());
        }
        ::closedir(d);
      }
    }
  }
  if (absl::Status s = comm::broadcast_object(group, verdict, 0); !s.ok()) return s;
  if (!verdict.toStringRef().empty()) {
    return absl::UnavailableError(absl::StrCat("save_sharded(", dir, ") failed, nothing committed: ",
                                               verdict.toStringRef()));
  }
  return absl::OkStatus();
}

absl::StatusOr<ShardedInfo> read_sharded_info(const std::string& dir) {
  absl::StatusOr<c10::IValue> meta = load_state(absl::StrCat(dir, "/", kMetadata));
  if (!meta.ok()) {
    if (meta.status().code() != absl::StatusCode::kNotFound) return meta.status();
    bool has_shards = false;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (dirent* e = ::readdir(d)) has_shards |= absl::StartsWith(e->d_name, "shard-");
      ::closedir(d);
    } else {
      return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " does not exist"));
    }
    if (has_shards) {
      return absl::FailedPreconditionError(absl::StrCat("incomplete checkpoint: ", dir, " has shards but no ", kMetadata,
                                                        " (its commit marker); the save did not finish"));
    }
    return absl::NotFoundError(absl::StrCat(dir, " holds no sharded checkpoint (no ", kMetadata, ")"));
  }
  if (!meta->isGenericDict() || !meta->toGenericDict().contains("format") ||
      meta->toGenericDict().at("format") != c10::IValue(std::string(kFormat))) {
    return absl::DataLossError(absl::StrCat(dir, "/", kMetadata, " is not dtrain sharded-checkpoint metadata"));
  }
  auto m = meta->toGenericDict();
  ShardedInfo info;
  info.world_size = static_cast<int>(m.at("world_size").toInt());
  info.strategy = m.at("strategy").toStringRef();
  info.save_id = m.at("save_id").toStringRef();
  for (const auto& kv : m.at("shapes").toGenericDict()) {
    std::optional<std::vector<int64_t>> shape = int_list(kv.value());
    if (!shape || !kv.key().isInt()) {
      return absl::DataLossError(absl::StrCat(dir, "/", kMetadata, ": a parameter shape is not a list of ints"));
    }
    info.shapes[kv.key().toInt()] = *shape;
  }
  info.param_groups = m.at("param_groups");
  info.extra = m.at("extra");
  return info;
}

absl::StatusOr<ShardedState> load_sharded(const std::string& dir, const std::map<int64_t, ElementRange>& wanted) {
  absl::StatusOr<ShardedInfo> info = read_sharded_info(dir);
  if (!info.ok()) return info.status();
  auto meta = load_state(absl::StrCat(dir, "/", kMetadata))->toGenericDict();
  auto shards = meta.at("shards").toList();

  ShardedState out;
  out.param_groups = info->param_groups;
  out.extra = info->extra;
  std::map<size_t, Dict> loaded;  // shard number -> its params, read once
  auto shard_params = [&](size_t s) -> absl::StatusOr<Dict> {
    if (auto it = loaded.find(s); it != loaded.end()) return it->second;
    const std::string file = shards.get(s).toGenericDict().at("file").toStringRef();
    absl::StatusOr<c10::IValue> v = load_state(absl::StrCat(dir, "/", file));
    if (!v.ok()) {
      return absl::DataLossError(absl::StrCat("checkpoint ", dir, ": shard ", file, ": ", v.status().message()));
    }
    Dict params = v->toGenericDict().at("params").toGenericDict();
    loaded.emplace(s, params);
    return params;
  };

  for (const auto& [index, range] : wanted) {
    auto shape_it = info->shapes.find(index);
    if (shape_it == info->shapes.end()) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint ", dir, " has no state for parameter ", index));
    }
    const int64_t numel = numel_of(shape_it->second);
    if (range.begin < 0 || range.end > numel || range.begin > range.end) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", index, ": range [", range.begin, ", ", range.end,
                                                     ") outside its ", numel, " elements"));
    }
    ShardedState::Param p;
    p.shape = shape_it->second;
    p.range = range;
    int64_t covered = 0;
    for (size_t s = 0; s < shards.size(); ++s) {
      auto ranges = shards.get(s).toGenericDict().at("ranges").toGenericDict();
      const c10::IValue key(index);
      if (!ranges.contains(key)) continue;
      const std::optional<std::vector<int64_t>> r_or = int_list(ranges.at(key));
      if (!r_or || r_or->size() != 2 || (*r_or)[0] > (*r_or)[1]) {
        return absl::DataLossError(absl::StrCat("shard ", s, " of ", dir, ": the element range of parameter ", index,
                                                " is not [begin, end]"));
      }
      const std::vector<int64_t>& r = *r_or;
      const int64_t lo = std::max(r[0], range.begin), hi = std::min(r[1], range.end);
      if (hi <= lo && !(range.size() == 0 && r[0] <= range.begin && range.begin <= r[1])) continue;
      absl::StatusOr<Dict> params = shard_params(s);
      if (!params.ok()) return params.status();
      auto entries = params->at(key).toGenericDict().at("entries").toGenericDict();
      for (const auto& kv : entries) {
        const c10::IValue& v = kv.value();
        if (!v.isTensor() || v.toTensor().dim() == 0) {
          if (!p.entries.contains(kv.key())) p.entries.insert(kv.key(), v);
          continue;
        }
        const at::Tensor src = v.toTensor().reshape(-1);
        if (!p.entries.contains(kv.key())) {
          p.entries.insert(kv.key(), at::empty({range.size()}, src.options()));
        }
        at::Tensor dst = p.entries.at(kv.key()).toTensor();
        if (hi > lo) dst.narrow(0, lo - range.begin, hi - lo).copy_(src.narrow(0, lo - r[0], hi - lo));
      }
      covered += std::max<int64_t>(0, hi - lo);
    }
    if (covered != range.size()) {
      return absl::DataLossError(absl::StrCat("checkpoint ", dir, ": the shards cover ", covered, " of the ", range.size(),
                                              " requested elements of parameter ", index));
    }
    if (range.begin == 0 && range.end == numel) {
      for (const auto& kv : p.entries) {
        if (kv.value().isTensor() && kv.value().toTensor().dim() == 1 && kv.value().toTensor().numel() == numel) {
          p.entries.insert_or_assign(kv.key(), kv.value().toTensor().view(p.shape));
        }
      }
    }
    out.params.emplace(index, std::move(p));
  }
  return out;
}

}  // namespace dtrain::checkpoint
