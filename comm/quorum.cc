#include "comm/quorum.h"

#include <algorithm>
#include <map>
#include <thread>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "comm/exception_status.h"
#include "comm/libtorch_compat.h"
#include "comm/object_collectives.h"

namespace dtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(5);

std::string key(int64_t q, absl::string_view what) { return absl::StrCat("quorum/", q, "/", what); }

std::vector<uint8_t> bytes(absl::string_view s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

std::string encode(const QuorumMember& m) {
  return absl::StrCat(m.replica_id, ",", m.step, ",", m.has_update ? 1 : 0, ",", m.fresh ? 1 : 0);
}

// A member as encode() wrote it; anything else is DataLoss (the store is shared with the job).
absl::StatusOr<QuorumMember> decode(absl::string_view s) {
  std::vector<absl::string_view> f = absl::StrSplit(s, ',');
  QuorumMember m;
  int upd = -1;
  int fresh = -1;
  if (f.size() != 4 || !absl::SimpleAtoi(f[0], &m.replica_id) || !absl::SimpleAtoi(f[1], &m.step) ||
      !absl::SimpleAtoi(f[2], &upd) || !absl::SimpleAtoi(f[3], &fresh) || m.replica_id < 0 ||
      m.step < 0 || (upd != 0 && upd != 1) || (fresh != 0 && fresh != 1)) {
    return absl::DataLossError(absl::StrCat(
        "a quorum registration on the lighthouse's store reads '", s,
        "', not 'replica_id,step,has_update,fresh'; something else writes keys under 'quorum/' "
        "there: give the lighthouse a store of its own"));
  }
  m.has_update = upd == 1;
  m.fresh = fresh == 1;
  return m;
}

absl::StatusOr<std::vector<QuorumMember>> decode_list(absl::string_view s) {
  std::vector<QuorumMember> out;
  for (absl::string_view part : absl::StrSplit(s, ';', absl::SkipEmpty())) {
    absl::StatusOr<QuorumMember> m = decode(part);
    if (!m.ok()) return m.status();
    out.push_back(*m);
  }
  if (out.empty()) return absl::DataLossError("a quorum decision on the lighthouse lists nobody");
  return out;
}

std::string ids_text(const std::vector<QuorumMember>& ms) {
  std::vector<int64_t> ids;
  for (const QuorumMember& m : ms) ids.push_back(m.replica_id);
  return ids.empty() ? "none" : absl::StrJoin(ids, ", ");
}

// A client connection to the lighthouse's store.
c10::intrusive_ptr<c10d::Store> lighthouse_store(const QuorumOptions& o) {
  c10d::TCPStoreOptions so = tcp_store_options();
  so.port = static_cast<uint16_t>(o.lighthouse_port);
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = o.timeout;
  return c10::make_intrusive<c10d::TCPStore>(o.lighthouse_host, so);
}

// Whether `decision` (members, encoded) admits `me`.
bool admits(const std::string& decision, const QuorumMember& me) {
  absl::StatusOr<std::vector<QuorumMember>> members = decode_list(decision);
  if (!members.ok()) return true;  // join_decided reports it
  for (const QuorumMember& m : *members) {
    if (m.replica_id == me.replica_id && m.step == me.step && m.has_update == me.has_update)
      return true;
  }
  return false;
}

}  // namespace

bool Quorum::healing(int r) const { return members.at(r).step < max_step; }

bool Quorum::any_healing() const {
  for (size_t r = 0; r < members.size(); ++r)
    if (healing(static_cast<int>(r))) return true;
  return false;
}

std::vector<int> Quorum::participants() const {
  std::vector<int> out;
  for (size_t r = 0; r < members.size(); ++r)
    if (members[r].has_update && members[r].step == max_step) out.push_back(static_cast<int>(r));
  return out;
}

int Quorum::recover_src() const {
  const std::vector<int> p = participants();
  if (!p.empty()) return p.front();
  for (size_t r = 0; r < members.size(); ++r)
    if (members[r].step == max_step) return static_cast<int>(r);
  return 0;
}

std::vector<int64_t> Quorum::replica_ids() const {
  std::vector<int64_t> out;
  for (const QuorumMember& m : members) out.push_back(m.replica_id);
  return out;
}

std::string Quorum::describe() const {
  std::vector<int64_t> p;
  for (int r : participants()) p.push_back(members[r].replica_id);
  return absl::StrCat("quorum ", quorum_id, " (step ", max_step, "): replicas ",
                      absl::StrJoin(replica_ids(), ", "), " (participants ",
                      p.empty() ? "none" : absl::StrJoin(p, ", "), ")");
}

Lighthouse::Lighthouse(LighthouseOptions options) {
  TORCH_CHECK(options.port >= 0 && options.port <= 65535, "Lighthouse: port ", options.port,
              " is outside [0, 65535]; pass 0 for a free one");
  c10d::TCPStoreOptions o = tcp_store_options();
  o.port = static_cast<uint16_t>(options.port);
  o.isServer = true;
  o.waitWorkers = false;
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
    port_ = store->getPort();
    store_ = store;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "Lighthouse: cannot listen on port ", options.port, ": ", e.what(),
                "; is another program using it? pick another port, or 0 for a free one");
  }
}

int Lighthouse::port() const { return port_; }

QuorumClient::QuorumClient(QuorumOptions options, c10::intrusive_ptr<c10d::Store> store)
    : options_(std::move(options)), store_(std::move(store)) {}

absl::StatusOr<std::unique_ptr<QuorumClient>> QuorumClient::connect(const QuorumOptions& o) {
  if (o.lighthouse_port <= 0 || o.lighthouse_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuorumOptions::lighthouse_port is ", o.lighthouse_port,
                     "; set it to the port the job's Lighthouse listens on (Lighthouse::port())"));
  }
  if (o.replica_id < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuorumOptions::replica_id is ", o.replica_id,
                     "; give every replica group its own id >= 0, the same one when it restarts"));
  }
  if (o.min_replicas < 1 || o.expected_replicas < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QuorumOptions::min_replicas is ", o.min_replicas, " and expected_replicas ",
        o.expected_replicas, "; min_replicas must be >= 1 and expected_replicas >= 0"));
  }
  if (o.join_timeout.count() < 0 || o.quorum_timeout <= o.join_timeout || o.timeout.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuorumOptions: join_timeout ", o.join_timeout.count(), " ms, quorum_timeout ",
                     o.quorum_timeout.count(), " ms, timeout ", o.timeout.count(),
                     " ms; need 0 <= join_timeout < quorum_timeout and timeout > 0"));
  }
  try {
    return std::unique_ptr<QuorumClient>(new QuorumClient(o, lighthouse_store(o)));
  } catch (...) {
    return current_exception_status(
        absl::StatusCode::kUnavailable,
        absl::StrCat("QuorumClient: connecting to the lighthouse at ", o.lighthouse_host, ":",
                     o.lighthouse_port, " (is the Lighthouse running there?)"));
  }
}

absl::StatusOr<Quorum> QuorumClient::quorum(int64_t step, bool has_update) {
  TORCH_CHECK(step >= 0, "QuorumClient::quorum: step is ", step, "; pass the rounds committed");
  if (group_.is_member()) {
    destroy_process_group(group_);
    group_ = Group();
  }
  const QuorumMember me{options_.replica_id, step, has_update, fresh_};
  absl::StatusOr<std::pair<int64_t, std::string>> decided =
      !grouped() || options_.replica_group.rank() == 0
          ? decide(me)
          : absl::UnknownError("not decided here: rank 0 of the replica group decides");
  if (grouped()) decided = share_decision(std::move(decided));
  if (!decided.ok()) return decided.status();
  return join_decided(decided->first, decided->second, me);
}

absl::StatusOr<std::pair<int64_t, std::string>> QuorumClient::decide(const QuorumMember& me) {
  const Clock::time_point deadline = Clock::now() + options_.quorum_timeout;
  try {
    if (next_id_ == 0) {  // a new process: the first undecided quorum id
      int64_t q = 1;
      if (store_->check({"quorum/latest"})) {
        int64_t latest = 0;
        if (absl::SimpleAtoi(text(store_->get("quorum/latest")), &latest) && latest > 0) q = latest;
      }
      while (store_->check({key(q, "decision")})) ++q;
      next_id_ = q;
    }
    for (;;) {
      const int64_t q = next_id_++;
      absl::StatusOr<std::string> got = try_quorum(q, me, deadline);
      if (!got.ok()) return got.status();
      if (admits(*got, me)) return std::make_pair(q, *std::move(got));
      // Decided without this replica (it came too late): register for the next one.
    }
  } catch (...) {
    return current_exception_status(
        absl::StatusCode::kUnavailable,
        absl::StrCat("QuorumClient (replica ", options_.replica_id, "): the lighthouse at ",
                     options_.lighthouse_host, ":", options_.lighthouse_port, " failed"));
  }
}

absl::StatusOr<std::pair<int64_t, std::string>> QuorumClient::share_decision(
    absl::StatusOr<std::pair<int64_t, std::string>> decided) {
  // "ok <q> <decision>" or "error <code> <message>", from the replica group's rank 0.
  c10::IValue msg;
  if (options_.replica_group.rank() == 0) {
    msg = decided.ok() ? absl::StrCat("ok ", decided->first, " ", decided->second)
                       : absl::StrCat("error ", static_cast<int>(decided.status().code()), " ",
                                      decided.status().message());
  }
  if (absl::Status s = broadcast_object(options_.replica_group, msg, 0); !s.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "QuorumClient (replica ", options_.replica_id, ", rank ", options_.replica_group.rank(),
        " of its replica group): the replica group's ranks could not share the quorum: ",
        s.message(), "; a rank of this replica group was lost: restart the replica group"));
  }
  const std::vector<std::string> f =
      absl::StrSplit(msg.isString() ? msg.toStringRef() : "", absl::MaxSplits(' ', 2));
  int64_t number = 0;
  if (f.size() != 3 || !absl::SimpleAtoi(f[1], &number)) {
    return absl::DataLossError("QuorumClient: the replica group's rank 0 sent no quorum");
  }
  if (f[0] == "error") return absl::Status(static_cast<absl::StatusCode>(number), f[2]);
  return std::make_pair(number, f[2]);
}

absl::StatusOr<std::string> QuorumClient::try_quorum(int64_t q, const QuorumMember& me,
                                                     Clock::time_point deadline) {
  const int64_t slot = store_->add(key(q, "n"), 1);
  store_->set(key(q, absl::StrCat("slot/", slot)), bytes(encode(me)));
  const Clock::time_point registered = Clock::now();
  std::vector<QuorumMember> prev;
  if (q > 1 && store_->check({key(q - 1, "decision")})) {
    absl::StatusOr<std::vector<QuorumMember>> p =
        decode_list(text(store_->get(key(q - 1, "decision"))));
    if (!p.ok()) return p.status();
    prev = *p;
  }
  std::vector<QuorumMember> seen;
  std::string decision;
  while (decision.empty()) {
    if (store_->check({key(q, "decision")})) {
      decision = text(store_->get(key(q, "decision")));
      break;
    }
    std::map<int64_t, QuorumMember> by_id;  // a later registration of an id replaces an earlier
    const int64_t n = store_->add(key(q, "n"), 0);
    for (int64_t i = 1; i <= n; ++i) {
      const std::string k = key(q, absl::StrCat("slot/", i));
      if (!store_->check({k})) continue;  // counted, not yet written
      absl::StatusOr<QuorumMember> m = decode(text(store_->get(k)));
      if (!m.ok()) return m.status();
      by_id[m->replica_id] = *m;
    }
    seen.clear();
    for (const auto& [id, m] : by_id) seen.push_back(m);
    bool fast = false;  // every member of quorum q - 1 (at q = 1: expected_replicas) is here
    if (q == 1) {
      fast = options_.expected_replicas > 0 &&
             static_cast<int>(seen.size()) >= options_.expected_replicas;
    } else {
      fast = !prev.empty();
      for (const QuorumMember& p : prev) fast = fast && by_id.count(p.replica_id) > 0;
    }
    bool holds_state = q == 1;
    for (const QuorumMember& m : seen) holds_state = holds_state || !m.fresh;
    const bool waited = Clock::now() - registered >= options_.join_timeout;
    if (static_cast<int>(seen.size()) >= options_.min_replicas && holds_state && (fast || waited)) {
      std::vector<std::string> parts;
      for (const QuorumMember& m : seen) parts.push_back(encode(m));
      decision = text(store_->compareSet(key(q, "decision"), {}, bytes(absl::StrJoin(parts, ";"))));
      break;
    }
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "replica ", options_.replica_id, ": no quorum within quorum_timeout (",
          options_.quorum_timeout.count(), " ms) at quorum id ", q, "; registered: replicas ",
          ids_text(seen), "; previous quorum: replicas ", ids_text(prev), "; min_replicas ",
          options_.min_replicas,
          holds_state ? ""
                      : "; every registered replica is a new process, and a new process "
                        "never starts a quorum of a running job (the state lives in the "
                        "others): start the replicas that hold it, or restart the job",
          "; raise quorum_timeout if the others are only slow"));
    }
    std::this_thread::sleep_for(kPoll);
  }
  store_->set("quorum/latest", bytes(absl::StrCat(q)));
  return decision;
}

absl::StatusOr<Quorum> QuorumClient::join_decided(int64_t q, const std::string& decision,
                                                  const QuorumMember& me) {
  absl::StatusOr<std::vector<QuorumMember>> members = decode_list(decision);
  if (!members.ok()) return members.status();
  Quorum out;
  out.quorum_id = q;
  out.members = *members;
  for (size_t r = 0; r < out.members.size(); ++r) {
    out.max_step = std::max(out.max_step, out.members[r].step);
    if (out.members[r].replica_id == me.replica_id && out.members[r].step == me.step &&
        out.members[r].has_update == me.has_update)
      out.rank = static_cast<int>(r);
  }
  if (out.rank < 0) return absl::NotFoundError("left out");
  InitOptions io;
  io.backend = "gloo";
  // A connection of its own: a rendezvous that times out leaves its connection expecting a reply
  // that may come later, which must not reach the quorum protocol's.
  // With a replica group of several ranks, rank i of each member replica group meets under its own
  // prefix.
  io.store = c10::make_intrusive<c10d::PrefixStore>(
      grouped() ? key(q, absl::StrCat("pg/", options_.replica_group.rank())) : key(q, "pg"),
      lighthouse_store(options_));
  io.rank = out.rank;
  io.world_size = static_cast<int>(out.members.size());
  io.timeout = options_.timeout;
  io.gloo_hostname = options_.gloo_hostname;
  absl::StatusOr<Group> g = init_process_group(io);
  if (grouped()) {  // every rank of the replica group formed its group, or none goes on
    at::Tensor formed = at::full({1}, g.ok() ? 0 : 1, at::kInt);
    std::vector<at::Tensor> bufs = {formed};
    try {
      options_.replica_group->allreduce(bufs)->wait();
    } catch (...) {
      if (g.ok()) destroy_process_group(*g);
      return current_exception_status(
          absl::StatusCode::kUnavailable,
          absl::StrCat("QuorumClient (replica ", options_.replica_id,
                       "): the replica group's ranks could not agree on the quorum's groups; a "
                       "rank of this replica group was lost: restart the replica group"));
    }
    if (g.ok() && formed.item<int>() > 0) {
      destroy_process_group(*g);
      g = absl::AbortedError(
          absl::StrCat(formed.item<int>(), " rank(s) of this replica group could not form theirs"));
    }
  }
  if (!g.ok()) {
    return absl::AbortedError(absl::StrCat("replica ", options_.replica_id, ": the group of ",
                                           out.describe(), " did not form: ", g.status().message(),
                                           "; a member may have died since: call quorum() again"));
  }
  out.group = *g;
  group_ = *g;
  fresh_ = false;
  return out;
}

}  // namespace dtrain::comm
