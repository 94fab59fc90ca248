#include "checkpoint/consolidation.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/optimizer_state_dict.h"
#include "comm/agreement.h"
#include "comm/object_collectives.h"

namespace dtrain::checkpoint {
namespace {

constexpr int kTag = 0x5ca1ab;
// Most bytes the target holds in device buffers at once when receiving on a GPU (NCCL).
constexpr int64_t kDeviceStagingBytes = int64_t{64} << 20;

absl::Status malformed(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("consolidate_state_dict: ", what));
}

// One state entry of a rank, as it travels (pickled) to the target: its parameter index, key, and
// either the value itself (non-tensors) or the tensor's dtype and shape (its data follows point
// to point). Encoded as the tuple (index, key, False, value, None) or (index, key, True, dtype,
// shape).
struct EntryDescription {
  int64_t index = 0;
  c10::IValue key;
  bool tensor = false;
  c10::IValue value;  // non-tensors
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;

  c10::IValue encode() const {
    if (!tensor) return c10::ivalue::Tuple::create({index, key, false, value, c10::IValue()});
    return c10::ivalue::Tuple::create(
        {index, key, true, static_cast<int64_t>(dtype), c10::List<int64_t>(shape)});
  }
  static EntryDescription decode(const c10::IValue& v) {
    const auto& t = v.toTupleRef().elements();
    EntryDescription d;
    d.index = t[0].toInt();
    d.key = t[1];
    d.tensor = t[2].toBool();
    if (d.tensor) {
      d.dtype = static_cast<at::ScalarType>(t[3].toInt());
      d.shape = t[4].toIntVector();
    } else {
      d.value = t[3];
    }
    return d;
  }
};

// What a rank sends the target: its entries' descriptions (by index) and its param groups.
// Encoded as the list [[entry...], param_groups].
struct RankPart {
  std::vector<EntryDescription> entries;
  std::vector<ParamGroup> groups;

  c10::IValue encode() const {
    c10::impl::GenericList list(c10::AnyType::get());
    for (const EntryDescription& e : entries) list.push_back(e.encode());
    c10::impl::GenericList out(c10::AnyType::get());
    out.push_back(list);
    out.push_back(param_groups_to_ivalue(groups));
    return out;
  }
  static absl::StatusOr<RankPart> decode(const c10::IValue& v, int rank) {
    const auto parts = v.toList();
    RankPart out;
    for (const c10::IValue& e : parts.get(0).toListRef())
      out.entries.push_back(EntryDescription::decode(e));
    absl::StatusOr<std::vector<ParamGroup>> groups =
        parse_param_groups(parts.get(1), absl::StrCat("rank ", rank));
    if (!groups.ok()) return groups.status();
    out.groups = *std::move(groups);
    return out;
  }
};

// This rank's descriptions (index order, so the target merges in order) and the tensors whose
// data follows, in entry order: contiguous, on the CPU for the target (they are its result),
// where they are for the others (sent piece by piece through the group's device).
RankPart describe(const OptimizerStateDict& sd, bool target, std::vector<at::Tensor>& tensors) {
  RankPart part;
  part.groups = sd.param_groups;
  for (const auto& [index, entry] : sd.state) {
    for (const auto& kv : entry) {
      EntryDescription d;
      d.index = index;
      d.key = kv.key();
      const c10::IValue& v = kv.value();
      if (v.isTensor()) {
        const at::Tensor& t = v.toTensor();
        d.tensor = true;
        d.dtype = t.scalar_type();
        d.shape = t.sizes().vec();
        const at::Tensor plain = t.detach().resolve_conj().resolve_neg();
        tensors.push_back(target ? plain.to(at::kCPU).contiguous() : plain.contiguous());
      } else {
        d.value = v;
      }
      part.entries.push_back(std::move(d));
    }
  }
  return part;
}

// A piece's bytes, as they travel: every dtype is bytes to the transport (NCCL has no complex).
at::Tensor bytes_of(const at::Tensor& piece) { return piece.view(at::kByte); }

// Receives each rank's pieces, in the order it sends them, into CPU tensors. On a CPU group
// straight into them, all ranks at once; on a GPU group (NCCL sends only device tensors) through
// device buffers of at most kDeviceStagingBytes, a piece from every rank in turn so that no sender
// waits for all the others, each copied to its CPU tensor once received.
void receive_all(const comm::Group& group, const std::vector<std::vector<at::Tensor>>& pieces) {
  const c10::Device device = group.device();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  if (device.is_cpu()) {
    for (size_t r = 0; r < pieces.size(); ++r) {
      for (const at::Tensor& piece : pieces[r]) {
        std::vector<at::Tensor> v = {bytes_of(piece)};
        works.push_back(group->recv(v, static_cast<int>(r), kTag));
      }
    }
    for (auto& w : works) w->wait();
    return;
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> staged;  // (device buffer, CPU destination)
  int64_t staged_bytes = 0;
  auto drain = [&] {
    for (auto& w : works) w->wait();
    for (auto& [buffer, destination] : staged) destination.copy_(buffer);  // synchronous
    works.clear();
    staged.clear();
    staged_bytes = 0;
  };
  for (size_t k = 0, left = 1; left > 0; ++k) {
    left = 0;
    for (size_t r = 0; r < pieces.size(); ++r) {
      if (k >= pieces[r].size()) continue;
      ++left;
      const at::Tensor destination = bytes_of(pieces[r][k]);
      const auto nbytes = static_cast<int64_t>(destination.numel());
      if (!staged.empty() && staged_bytes + nbytes > kDeviceStagingBytes) drain();
      at::Tensor buffer = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(device));
      std::vector<at::Tensor> v = {buffer};
      works.push_back(group->recv(v, static_cast<int>(r), kTag));
      staged.emplace_back(std::move(buffer), destination);
      staged_bytes += nbytes;
    }
  }
  drain();
}

// The target's check of every rank's description, before any data moves: each decodes, has as
// many param groups as the target's, and holds parameters no other rank holds. `parts` gets the
// decoded descriptions, the target's own (`mine`) at `to`.
absl::Status check_parts(const RankPart& mine, const std::vector<c10::IValue>& all, int to, int n,
                         std::vector<RankPart>& parts) {
  for (int r = 0; r < n; ++r) {
    absl::StatusOr<RankPart> part =
        r == to ? absl::StatusOr<RankPart>(mine) : RankPart::decode(all[r], r);
    if (!part.ok()) return malformed(std::string(part.status().message()));
    parts.push_back(*std::move(part));
  }
  std::map<int64_t, int> holder;
  const size_t num_groups = mine.groups.size();
  for (int r = 0; r < n; ++r) {
    if (parts[r].groups.size() != num_groups) {
      return malformed(absl::StrCat("rank ", r, " has ", parts[r].groups.size(),
                                    " param groups, rank ", to, " has ", num_groups,
                                    "; every rank must pass the same groups"));
    }
    std::set<int64_t> seen_here;
    for (const EntryDescription& e : parts[r].entries) {
      if (!seen_here.insert(e.index).second) continue;
      auto [it, inserted] = holder.emplace(e.index, r);
      if (!inserted) {
        return malformed(absl::StrCat("state of parameter ", e.index, " is held by both rank ",
                                      it->second, " and rank ", r,
                                      "; each parameter's state must live on one rank"));
      }
    }
  }
  return absl::OkStatus();
}

// Calls `f` on `t`'s consecutive pieces of at most `chunk_bytes` (at least one element each).
void for_each_chunk(const at::Tensor& t, int64_t chunk_bytes,
                    const std::function<void(at::Tensor)>& f) {
  at::Tensor flat = t.reshape(-1);
  const int64_t per = std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(1, t.element_size()));
  for (int64_t b = 0; b < flat.numel(); b += per)
    f(flat.narrow(0, b, std::min(per, flat.numel() - b)));
}

// A sender's part: this rank's tensors to `to` in order, chunk by chunk: straight from their
// storage where they are on the group's device, else through a copy of one chunk there.
absl::Status send_tensors(const comm::Group& group, const std::vector<at::Tensor>& tensors, int to,
                          int64_t chunk_bytes) {
  try {
    const c10::Device device = group.device();
    for (const at::Tensor& t : tensors) {
      for_each_chunk(t, chunk_bytes, [&](at::Tensor piece) {
        std::vector<at::Tensor> v = {bytes_of(piece.to(device))};
        group->send(v, to, kTag)->wait();
      });
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("consolidate_state_dict: sending to rank ", to, ": ", e.what()));
  }
  return absl::OkStatus();
}

// The target's part: every rank's state dict with each final tensor allocated on the CPU, then
// received into (the target's own tensors taken from `my_tensors`, already on the CPU).
absl::Status receive_parts(const comm::Group& group, const std::vector<RankPart>& parts,
                           const std::vector<at::Tensor>& my_tensors, int to, int64_t chunk_bytes,
                           std::vector<OptimizerStateDict>& received) {
  const int n = static_cast<int>(received.size());
  std::vector<std::vector<at::Tensor>> pieces(n);  // each rank's, in the order it sends them
  try {
    for (int r = 0; r < n; ++r) {
      received[r].param_groups = parts[r].groups;
      size_t next_local = 0;
      for (const EntryDescription& e : parts[r].entries) {
        auto it = received[r].state.find(e.index);
        if (it == received[r].state.end())
          it = received[r].state.emplace(e.index, new_state_entry()).first;
        if (!e.tensor) {
          it->second.insert(e.key, e.value);
          continue;
        }
        at::Tensor t;
        if (r == to) {
          t = my_tensors[next_local++];  // our own, already on the CPU (describe)
        } else {
          t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
          for_each_chunk(t, chunk_bytes, [&](at::Tensor piece) { pieces[r].push_back(piece); });
        }
        it->second.insert(e.key, t);
      }
    }
    receive_all(group, pieces);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("consolidate_state_dict: receiving on rank ", to, ": ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<c10::IValue> consolidate_state_dict(const comm::Group& group,
                                                   const c10::IValue& local_state_dict, int to,
                                                   const ConsolidateOptions& options) {
  if (!group.is_member()) {
    return absl::FailedPreconditionError(
        "consolidate_state_dict: this rank is not a member of the group");
  }
  if (to < 0 || to >= group.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "consolidate_state_dict: to=", to, " is not a rank of this group of ", group.size()));
  }
  if (options.chunk_bytes < 1) return malformed("chunk_bytes must be positive");
  absl::StatusOr<OptimizerStateDict> sd =
      parse_optimizer_state_dict(local_state_dict, "the local state dict");
  if (!sd.ok()) return malformed(std::string(sd.status().message()));
  const bool target = group.rank() == to;
  std::vector<at::Tensor> my_tensors;
  const RankPart mine = describe(*sd, target, my_tensors);

  // 1. Descriptions (small, pickled) to the target.
  absl::StatusOr<std::vector<c10::IValue>> all = comm::gather_object(group, mine.encode(), to);
  if (!all.ok()) return all.status();

  const int n = group.size();
  // 2. The target checks the descriptions and tells every rank before any data moves, so a bad
  // input fails on all ranks at once instead of leaving senders blocked.
  absl::Status verdict;
  std::vector<RankPart> parts;
  if (target) verdict = check_parts(mine, *all, to, n, parts);
  if (absl::Status s = comm::share_verdict(group, verdict, to); !s.ok()) return s;

  if (!target) {
    // 3a. Send this rank's tensors.
    if (absl::Status s = send_tensors(group, my_tensors, to, options.chunk_bytes); !s.ok())
      return s;
    return c10::IValue();
  }

  // 3b. Target: allocate every final tensor on the CPU, then receive into it.
  std::vector<OptimizerStateDict> received(n);
  if (absl::Status s = receive_parts(group, parts, my_tensors, to, options.chunk_bytes, received);
      !s.ok())
    return s;

  // 4. One dict: state the union (disjoint, checked above), groups' options from the target and
  // their params the sorted union.
  absl::StatusOr<OptimizerStateDict> merged = merge(received, static_cast<size_t>(to));
  if (!merged.ok()) return malformed(std::string(merged.status().message()));
  return to_ivalue(*merged);
}

}  // namespace dtrain::checkpoint
