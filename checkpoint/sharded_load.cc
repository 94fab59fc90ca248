// sharded.h's load half: the metadata, parsed and checked, and the pieces a rank asks for. The
// save half is sharded.cc.
#include <dirent.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/internal/sharded_format.h"
#include "checkpoint/optimizer_state_dict.h"
#include "checkpoint/sharded.h"
#include "checkpoint/state_file.h"

namespace dtrain::checkpoint {

using sharded_internal::Dict;
using sharded_internal::int_list;
using sharded_internal::kFormat;
using sharded_internal::kMetadata;
using sharded_internal::numel_of;

namespace {

// The metadata, validated: every field's type, shapes without negative dims or overflow, shard
// file names that stay inside the directory, ranges inside their parameter.
struct ParsedShard {
  std::string file;
  std::map<int64_t, std::pair<int64_t, int64_t>> ranges;
};
struct ParsedMetadata {
  ShardedInfo info;
  std::vector<ParsedShard> shards;
};

absl::StatusOr<ParsedMetadata> parse_metadata(const c10::IValue& meta, const std::string& file) {
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(
        absl::StrCat(file, ": ", what, "; it is not metadata a dtrain save_sharded wrote"));
  };
  if (!meta.isGenericDict()) return bad("not a dict");
  const Dict m = meta.toGenericDict();
  auto field = [&](const char* key) -> std::optional<c10::IValue> {
    if (!m.contains(c10::IValue(key))) return std::nullopt;
    return m.at(c10::IValue(key));
  };
  const auto format = field("format");
  if (!format || !format->isString() || format->toStringRef() != kFormat) {
    return bad("its format is not \"dtrain-sharded v1\"");
  }
  ParsedMetadata out;
  const auto world = field("world_size");
  if (!world || !world->isInt() || world->toInt() < 1 || world->toInt() > (1 << 20))
    return bad("bad world_size");
  out.info.world_size = static_cast<int>(world->toInt());
  const auto strategy = field("strategy"), save_id = field("save_id");
  if (!strategy || !strategy->isString() || !save_id || !save_id->isString())
    return bad("bad strategy or save_id");
  out.info.strategy = strategy->toStringRef();
  out.info.save_id = save_id->toStringRef();
  const auto shapes = field("shapes");
  if (!shapes || !shapes->isGenericDict()) return bad("no shapes");
  for (const auto& kv : shapes->toGenericDict()) {
    std::optional<std::vector<int64_t>> shape = int_list(kv.value());
    if (!shape || !kv.key().isInt() || kv.key().toInt() < 0)
      return bad("a parameter shape is not a list of ints");
    int64_t numel = 1;
    for (int64_t d : *shape) {
      if (d < 0 || __builtin_mul_overflow(numel, d, &numel) || numel > (int64_t{1} << 48)) {
        return bad(absl::StrCat("parameter ", kv.key().toInt(), " has an impossible shape"));
      }
    }
    out.info.shapes[kv.key().toInt()] = *shape;
  }
  const auto groups = field(kParamGroupsKey), extra = field("extra"), shards = field("shards");
  if (!groups || !extra) return bad("no param_groups or extra");
  out.info.param_groups = *groups;
  out.info.extra = *extra;
  if (!shards || !shards->isList()) return bad("no shard list");
  for (const c10::IValue& sh : shards->toListRef()) {
    if (!sh.isGenericDict()) return bad("a shard entry is not a dict");
    const Dict d = sh.toGenericDict();
    if (!d.contains(c10::IValue("file")) || !d.at(c10::IValue("file")).isString() ||
        !d.contains(c10::IValue("ranges")) || !d.at(c10::IValue("ranges")).isGenericDict()) {
      return bad("a shard entry lacks its file or ranges");
    }
    ParsedShard ps;
    ps.file = d.at(c10::IValue("file")).toStringRef();
    if (ps.file.empty() || ps.file.find('/') != std::string::npos || ps.file == "." ||
        ps.file == "..") {
      return bad(absl::StrCat("shard file name '", ps.file.substr(0, 64),
                              "' is not a file in this directory"));
    }
    for (const auto& kv : d.at(c10::IValue("ranges")).toGenericDict()) {
      const std::optional<std::vector<int64_t>> r = int_list(kv.value());
      if (!kv.key().isInt() || !r || r->size() != 2)
        return bad("a shard's element range is not [begin, end]");
      auto shape = out.info.shapes.find(kv.key().toInt());
      if (shape == out.info.shapes.end())
        return bad(absl::StrCat("a shard holds parameter ", kv.key().toInt(), " without a shape"));
      const int64_t n = numel_of(shape->second);
      if ((*r)[0] < 0 || (*r)[0] > (*r)[1] || (*r)[1] > n) {
        return bad(absl::StrCat("shard ", ps.file, " holds elements [", (*r)[0], ", ", (*r)[1],
                                ") of parameter ", kv.key().toInt(), ", which has ", n));
      }
      ps.ranges[kv.key().toInt()] = {(*r)[0], (*r)[1]};
    }
    out.shards.push_back(std::move(ps));
  }
  return out;
}

absl::StatusOr<ParsedMetadata> read_metadata(const std::string& dir) {
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
      return absl::FailedPreconditionError(
          absl::StrCat("incomplete checkpoint: ", dir, " has shards but no ", kMetadata,
                       " (its commit marker); the save did not finish"));
    }
    return absl::NotFoundError(
        absl::StrCat(dir, " holds no sharded checkpoint (no ", kMetadata, ")"));
  }
  // Everything is validated once, here, before any of it is used: types, ranges, shapes, names.
  absl::StatusOr<ParsedMetadata> parsed = parse_metadata(*meta, absl::StrCat(dir, "/", kMetadata));
  if (!parsed.ok()) return parsed.status();
  return parsed;
}

}  // namespace

absl::StatusOr<ShardedInfo> read_sharded_info(const std::string& dir) {
  absl::StatusOr<ParsedMetadata> parsed = read_metadata(dir);
  if (!parsed.ok()) return parsed.status();
  return parsed->info;
}

namespace {

// Copies one shard's entries of a parameter into `p`: the shard holds elements [held.begin,
// held.end) of a parameter of `numel` elements, of which [part.begin, part.end) fall in the
// requested `range`.
absl::Status copy_entries(const Dict& entries, const std::string& where, partition::Range held,
                          partition::Range part, partition::Range range, int64_t numel,
                          ShardedState::Param* out) {
  const int64_t r0 = held.begin, r1 = held.end, lo = part.begin, hi = part.end;
  ShardedState::Param& p = *out;
  for (const auto& kv : entries) {
    const c10::IValue& v = kv.value();
    if (!kv.key().isString())
      return absl::DataLossError(absl::StrCat(where, ": a state key is not a string"));
    if (!v.isTensor() || v.toTensor().dim() == 0) {
      if (!p.entries.contains(kv.key())) p.entries.insert(kv.key(), v);
      continue;
    }
    if (r0 == 0 && r1 == numel && v.toTensor().numel() != numel) {
      // The parameter's own state of another size (Adafactor's factored variances), saved
      // with the whole parameter: it loads only with the whole parameter.
      if (range.begin != 0 || range.end != numel) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": state '", kv.key().toStringRef(), "' is not element-wise (",
            v.toTensor().numel(), " values for ", numel,
            " elements); load this parameter whole (a partition that does not split it)"));
      }
      if (!p.entries.contains(kv.key())) p.entries.insert(kv.key(), v);
      continue;
    }
    const at::Tensor src =
        v.toTensor().reshape(-1);  // whole parameters keep their shape in a shard
    if (src.numel() != r1 - r0) {
      return absl::DataLossError(absl::StrCat(where, ": state '", kv.key().toStringRef(),
                                              "' holds ", src.numel(), " elements for the range [",
                                              r0, ", ", r1, ")"));
    }
    if (!p.entries.contains(kv.key())) {
      p.entries.insert(kv.key(), at::empty({range.size()}, src.options()));
    }
    const c10::IValue& have = p.entries.at(kv.key());
    if (!have.isTensor() || have.toTensor().scalar_type() != src.scalar_type()) {
      return absl::DataLossError(
          absl::StrCat(where, ": state '", kv.key().toStringRef(),
                       "' has another type or dtype than in the other shards"));
    }
    if (hi > lo)
      have.toTensor().narrow(0, lo - range.begin, hi - lo).copy_(src.narrow(0, lo - r0, hi - lo));
  }
  return absl::OkStatus();
}

// A shard is the one the metadata names: written by the same rank (and save, where a shard records
// its save_id); shards before these fields were recorded are taken on their ranges alone.
absl::Status check_shard_identity(const Dict& shard, size_t rank, const std::string& save_id,
                                  const std::string& where) {
  auto moved = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(
        where, " was written by ", what,
        ": a shard of another rank or save was put in its place; restore the shard this save "
        "wrote, or load an earlier checkpoint"));
  };
  if (shard.contains(c10::IValue("save_id"))) {
    const c10::IValue id = shard.at(c10::IValue("save_id"));
    if (!id.isString() || id.toStringRef() != save_id)
      return moved(absl::StrCat("another save (", id.isString() ? id.toStringRef() : "?",
                                ", the metadata's is ", save_id, ")"));
  }
  if (shard.contains(c10::IValue("rank"))) {
    const c10::IValue r = shard.at(c10::IValue("rank"));
    if (!r.isInt() || r.toInt() != static_cast<int64_t>(rank))
      return moved(
          absl::StrCat("rank ", r.isInt() ? std::to_string(r.toInt()) : "?", ", not rank ", rank));
  }
  return absl::OkStatus();
}

// A shard's record of a parameter says what the metadata says: the same element range and shape.
absl::Status check_held(const Dict& held, const std::string& where, std::pair<int64_t, int64_t> r,
                        const std::vector<int64_t>& shape) {
  auto list_is = [&](const char* key, const std::vector<int64_t>& want) {
    if (!held.contains(c10::IValue(key)) || !held.at(c10::IValue(key)).isList()) return false;
    std::vector<int64_t> got;  // an empty list reads back untyped
    for (const c10::IValue& v : held.at(c10::IValue(key)).toListRef()) {
      if (!v.isInt()) return false;
      got.push_back(v.toInt());
    }
    return got == want;
  };
  if (!list_is("range", {r.first, r.second})) {
    return absl::DataLossError(absl::StrCat(
        where, ": the shard holds another element range than the metadata's [", r.first, ", ",
        r.second, "): a shard of another rank or save was put in its place"));
  }
  if (!list_is("shape", shape)) {
    return absl::DataLossError(
        absl::StrCat(where, ": the shard records another shape than the metadata's [",
                     absl::StrJoin(shape, ", "), "]"));
  }
  return absl::OkStatus();
}

// The shards' params dicts, each file read (and its identity checked) once.
class ShardFiles {
 public:
  ShardFiles(const std::string& dir, const ParsedMetadata& meta) : dir_(dir), meta_(meta) {}

  absl::StatusOr<Dict> params(size_t s) {
    if (auto it = loaded_.find(s); it != loaded_.end()) return it->second;
    const std::string& file = meta_.shards[s].file;
    absl::StatusOr<c10::IValue> v = load_state(absl::StrCat(dir_, "/", file));
    if (!v.ok()) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", dir_, ": shard ", file, ": ", v.status().message()));
    }
    if (!v->isGenericDict() || !v->toGenericDict().contains(c10::IValue("params")) ||
        !v->toGenericDict().at(c10::IValue("params")).isGenericDict()) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", dir_, ": shard ", file, " has no 'params' dict"));
    }
    if (absl::Status mine =
            check_shard_identity(v->toGenericDict(), s, meta_.info.save_id,
                                 absl::StrCat("checkpoint ", dir_, ": shard ", file));
        !mine.ok()) {
      return mine;
    }
    Dict params = v->toGenericDict().at(c10::IValue("params")).toGenericDict();
    loaded_.emplace(s, params);
    return params;
  }

 private:
  const std::string& dir_;
  const ParsedMetadata& meta_;
  std::map<size_t, Dict> loaded_;  // shard number -> its params
};

// The pieces must tile the range exactly: no gap (which would leave uninitialised memory), no
// overlap (two shards claiming one element).
absl::Status check_tiling(std::vector<std::pair<int64_t, int64_t>> pieces, partition::Range range,
                          int64_t index, const std::string& dir) {
  std::sort(pieces.begin(), pieces.end());
  int64_t at_element = range.begin;
  for (const auto& [lo, hi] : pieces) {
    if (lo != at_element) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint ", dir, ": the shards ", lo < at_element ? "overlap" : "leave a gap",
          " at element ", std::min(lo, at_element), " of parameter ", index));
    }
    at_element = hi;
  }
  if (at_element != range.end) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint ", dir, ": the shards cover elements [", range.begin, ", ", at_element,
        ") of the requested [", range.begin, ", ", range.end, ") of parameter ", index));
  }
  return absl::OkStatus();
}

// Parameter `index`'s elements `range` (of a parameter of `shape`), from every shard holding part
// of them.
absl::StatusOr<ShardedState::Param> load_param(const std::string& dir, const ParsedMetadata& meta,
                                               ShardFiles& files, int64_t index,
                                               partition::Range range,
                                               const std::vector<int64_t>& shape) {
  const int64_t numel = numel_of(shape);
  ShardedState::Param p;
  p.shape = shape;
  p.range = range;
  std::vector<std::pair<int64_t, int64_t>> pieces;  // the parts of `range` the shards hold
  for (size_t s = 0; s < meta.shards.size(); ++s) {
    auto r_it = meta.shards[s].ranges.find(index);
    if (r_it == meta.shards[s].ranges.end()) continue;
    const auto [r0, r1] = r_it->second;  // 0 <= r0 <= r1 <= numel (parse_metadata)
    const int64_t lo = std::max(r0, range.begin), hi = std::min(r1, range.end);
    if (hi <= lo && !(range.size() == 0 && r0 <= range.begin && range.begin <= r1)) continue;
    absl::StatusOr<Dict> params = files.params(s);
    if (!params.ok()) return params.status();
    const std::string where =
        absl::StrCat("checkpoint ", dir, ": shard ", meta.shards[s].file, ", parameter ", index);
    const c10::IValue key(index);
    if (!params->contains(key) || !params->at(key).isGenericDict() ||
        !params->at(key).toGenericDict().contains(c10::IValue("entries")) ||
        !params->at(key).toGenericDict().at(c10::IValue("entries")).isGenericDict()) {
      return absl::DataLossError(
          absl::StrCat(where, ": no state entries, though the metadata says it is there"));
    }
    const Dict held = params->at(key).toGenericDict();
    if (absl::Status same = check_held(held, where, {r0, r1}, shape); !same.ok()) return same;
    const Dict entries = held.at(c10::IValue("entries")).toGenericDict();
    if (absl::Status st = copy_entries(entries, where, {r0, r1}, {lo, hi}, range, numel, &p);
        !st.ok()) {
      return st;
    }
    if (hi > lo) pieces.emplace_back(lo, hi);
  }
  if (absl::Status tiled = check_tiling(std::move(pieces), range, index, dir); !tiled.ok())
    return tiled;
  if (range.begin == 0 && range.end == numel) {
    for (const auto& kv : p.entries) {
      if (kv.value().isTensor() && kv.value().toTensor().dim() == 1 &&
          kv.value().toTensor().numel() == numel) {
        p.entries.insert_or_assign(kv.key(), kv.value().toTensor().view(p.shape));
      }
    }
  }
  return p;
}

absl::StatusOr<ShardedState> load_checked(const std::string& dir,
                                          const std::map<int64_t, partition::Range>& wanted) {
  absl::StatusOr<ParsedMetadata> meta = read_metadata(dir);
  if (!meta.ok()) return meta.status();
  const ShardedInfo& info = meta->info;
  ShardedState out;
  out.param_groups = info.param_groups;
  out.extra = info.extra;
  ShardFiles files(dir, *meta);
  for (const auto& [index, range] : wanted) {
    auto shape_it = info.shapes.find(index);
    if (shape_it == info.shapes.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint ", dir, " has no state for parameter ", index));
    }
    const int64_t numel = numel_of(shape_it->second);
    if (range.begin < 0 || range.end > numel || range.begin > range.end) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", index, ": range [", range.begin,
                                                     ", ", range.end, ") outside its ", numel,
                                                     " elements"));
    }
    absl::StatusOr<ShardedState::Param> p =
        load_param(dir, *meta, files, index, range, shape_it->second);
    if (!p.ok()) return p.status();
    out.params.emplace(index, *std::move(p));
  }
  return out;
}

}  // namespace

absl::StatusOr<ShardedState> load_sharded(const std::string& dir,
                                          const std::map<int64_t, partition::Range>& wanted,
                                          const LoadOptions& options) {
  absl::StatusOr<ShardedState> out = absl::UnknownError("not loaded");
  try {
    out = load_checked(dir, wanted);
  } catch (const std::exception& e) {  // a backstop: every check above should have caught it first
    return absl::DataLossError(absl::StrCat(
        "checkpoint ", dir, " cannot be loaded: ", std::string(e.what()).substr(0, 300)));
  }
  if (!out.ok() || options.map_location.is_cpu()) return out;
  const c10::Device device = options.map_location;
  try {  // torch.load's map_location, on what was asked for only (each tensor its own storage)
    for (auto& param : out->params) {
      Dict& entries = param.second.entries;
      std::vector<std::pair<c10::IValue, at::Tensor>> moved;
      for (const auto& kv : entries) {
        if (kv.value().isTensor()) moved.emplace_back(kv.key(), kv.value().toTensor().to(device));
      }
      for (auto& [key, t] : moved) entries.insert_or_assign(key, std::move(t));
    }
  } catch (const c10::OutOfMemoryError& e) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "checkpoint ", dir, ": out of memory on ", device.str(), " (map_location): ",
        std::string(e.what()).substr(0, 300), "; load fewer parameters at once, or onto the CPU"));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint ", dir, ": cannot move the loaded state to ", device.str(),
                     " (map_location): ", std::string(e.what()).substr(0, 300),
                     "; pass a device this process has, or the CPU (the default)"));
  }
  return out;
}

}  // namespace dtrain::checkpoint
