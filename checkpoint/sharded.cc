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
#include "checkpoint/internal/sharded_format.h"
#include "checkpoint/optimizer_state_dict.h"
#include "checkpoint/state_file.h"
#include "comm/agreement.h"
#include "comm/object_collectives.h"

namespace dtrain::checkpoint {

using sharded_internal::Dict;
using sharded_internal::int_dict;
using sharded_internal::kFormat;
using sharded_internal::kMetadata;
using sharded_internal::numel_of;
using sharded_internal::str_dict;

namespace {

absl::Status check_param(int64_t index, const ShardedState::Param& p) {
  const int64_t numel = numel_of(p.shape);
  if (p.range.begin < 0 || p.range.end > numel || p.range.begin > p.range.end) {
    return absl::InvalidArgumentError(absl::StrCat("parameter ", index, ": range [", p.range.begin,
                                                   ", ", p.range.end, ") does not fit its ", numel,
                                                   " elements"));
  }
  for (const auto& kv : p.entries) {
    if (!kv.value().isTensor()) continue;
    const at::Tensor& t = kv.value().toTensor();
    const bool whole = p.range.begin == 0 && p.range.end == numel;
    if (t.numel() != p.range.size() && !(t.dim() == 0 && numel == 1)) {
      // 0-dim tensors (PyTorch's float "step") are per parameter, not per element; so are a
      // whole parameter's tensors of another size (Adafactor's factored variances).
      if (t.dim() != 0 && !whole) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter ", index, ": state '", kv.key().toStringRef(), "' has ",
                         t.numel(), " elements for a range of ", p.range.size()));
      }
    }
  }
  return absl::OkStatus();
}

std::string shard_name(const std::string& id, int rank) {
  return absl::StrCat("shard-", id, "-", rank, ".pt");
}

// What a rank tells rank 0 after writing its shard: its error ("" when it succeeded) and, per
// parameter it holds, the element range and the full shape. Travels pickled as the list
// [error, {index: (begin, end, shape)}].
struct ShardReport {
  std::string error;
  std::map<int64_t, std::pair<partition::Range, std::vector<int64_t>>> params;

  c10::IValue encode() const {
    Dict described = int_dict();
    for (const auto& [index, held] : params) {
      described.insert(index, c10::ivalue::Tuple::create({held.first.begin, held.first.end,
                                                          c10::List<int64_t>(held.second)}));
    }
    c10::impl::GenericList out(c10::AnyType::get());
    out.push_back(error);
    out.push_back(described);
    return out;
  }
  static ShardReport decode(const c10::IValue& v) {
    const auto list = v.toList();
    ShardReport out;
    out.error = list.get(0).toStringRef();
    for (const auto& kv : list.get(1).toGenericDict()) {
      const auto& t = kv.value().toTupleRef().elements();
      out.params[kv.key().toInt()] = {partition::Range{t[0].toInt(), t[1].toInt()},
                                      t[2].toIntVector()};
    }
    return out;
  }
};

// Step 2 of a save: this rank's shard file, and what it holds for rank 0's metadata.
absl::Status write_shard(const std::string& dir, const std::string& id, int rank,
                         const ShardedState& mine, ShardReport* report) {
  Dict params = int_dict();
  for (const auto& [index, p] : mine.params) {
    if (absl::Status ok = check_param(index, p); !ok.ok()) return ok;
    Dict entry = str_dict();
    entry.insert("range", c10::List<int64_t>({p.range.begin, p.range.end}));
    entry.insert("shape", c10::List<int64_t>(p.shape));
    entry.insert("entries", p.entries);
    params.insert(index, entry);
    report->params[index] = {p.range, p.shape};
  }
  Dict shard = str_dict();
  shard.insert("format", std::string(kFormat));
  // Which rank wrote it: a shard copied over another rank's is refused at load. (Not the save's
  // random id: a shard's bytes depend only on the state, so two saves of one state compare equal.)
  shard.insert("rank", static_cast<int64_t>(rank));
  shard.insert("params", params);
  return save_state(absl::StrCat(dir, "/", shard_name(id, rank)), shard);
}

// Shards of earlier saves in `dir`: garbage once save `id` is committed.
void remove_stale_shards(const std::string& dir, const std::string& id) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  const std::string keep = absl::StrCat("shard-", id, "-");
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (absl::StartsWith(name, "shard-") && !absl::StartsWith(name, keep))
      ::unlink((dir + "/" + name).c_str());
  }
  ::closedir(d);
}

// Step 3 on rank 0: every rank's report -> the metadata, written last (the commit), then the
// earlier saves' shards removed. The first failing rank's error, or rank 0's write error.
absl::Status commit_metadata(const std::string& dir, const std::string& id, int world,
                             const std::vector<c10::IValue>& reports, const ShardedState& mine,
                             const std::string& strategy) {
  auto failed = [&](const std::string& why) {
    return absl::UnavailableError(
        absl::StrCat("save_sharded(", dir, ") failed, nothing committed: ", why));
  };
  c10::impl::GenericList shards(c10::AnyType::get());
  Dict shapes = int_dict();
  for (int r = 0; r < world; ++r) {
    const ShardReport rep = ShardReport::decode(reports[r]);
    if (!rep.error.empty()) return failed(rep.error);
    Dict ranges = int_dict();
    for (const auto& [index, held] : rep.params) {
      ranges.insert(index, c10::List<int64_t>({held.first.begin, held.first.end}));
      shapes.insert_or_assign(index, c10::List<int64_t>(held.second));
    }
    Dict shard = str_dict();
    shard.insert("file", shard_name(id, r));
    shard.insert("ranges", ranges);
    shards.push_back(shard);
  }
  Dict meta = str_dict();
  meta.insert("format", std::string(kFormat));
  meta.insert("save_id", id);
  meta.insert("world_size", static_cast<int64_t>(world));
  meta.insert("strategy", strategy);
  meta.insert("shards", shards);
  meta.insert("shapes", shapes);
  meta.insert(kParamGroupsKey, mine.param_groups);
  meta.insert("extra", mine.extra);
  // The commit: until this rename the directory's previous checkpoint stays the valid one.
  if (absl::Status s = save_state(absl::StrCat(dir, "/", kMetadata), meta); !s.ok())
    return failed(absl::StrCat("rank 0 writing ", kMetadata, ": ", s.ToString()));
  remove_stale_shards(dir, id);
  return absl::OkStatus();
}

}  // namespace

absl::Status save_sharded(const comm::Group& group, const std::string& dir,
                          const ShardedState& mine, const std::string& strategy) {
  if (!group.is_member())
    return absl::FailedPreconditionError("save_sharded: this rank is not in the group");
  // 1. One id for this save, from rank 0.
  c10::IValue id{std::string()};
  if (group.rank() == 0)
    id = absl::StrFormat("%016x", std::random_device{}() * 4294967296ULL + std::random_device{}());
  // A transport failure names this rank and the step of the save it was in.
  auto on_rank = [&](const absl::Status& s, const char* step) {
    return absl::Status(s.code(), absl::StrCat("save_sharded(", dir, ") on rank ", group.rank(),
                                               ", ", step, ": ", s.message()));
  };
  if (absl::Status s = comm::broadcast_object(group, id, 0); !s.ok())
    return on_rank(s, "receiving the save's id from rank 0");

  // 2. This rank's shard, in parallel with the others.
  ShardReport report;
  const absl::Status written = write_shard(dir, id.toStringRef(), group.rank(), mine, &report);

  // 3. Rank 0 collects every rank's outcome and description, commits, and tells everyone.
  if (!written.ok()) report.error = absl::StrCat("rank ", group.rank(), ": ", written.ToString());
  absl::StatusOr<std::vector<c10::IValue>> reports = comm::gather_object(group, report.encode(), 0);
  if (!reports.ok()) {
    return on_rank(reports.status(), group.rank() == 0 ? "gathering every rank's outcome"
                                                       : "sending its outcome to rank 0");
  }
  const absl::Status verdict =
      group.rank() == 0
          ? commit_metadata(dir, id.toStringRef(), group.size(), *reports, mine, strategy)
          : absl::OkStatus();
  absl::Status shared = comm::share_verdict(group, verdict, 0);
  // Rank 0's verdict names the save; anything else is the transport's failure.
  if (!shared.ok() && !absl::StartsWith(shared.message(), "save_sharded(")) {
    return on_rank(shared,
                   group.rank() == 0 ? "sending the verdict" : "receiving rank 0's verdict");
  }
  return shared;
}

}  // namespace dtrain::checkpoint
