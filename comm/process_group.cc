#include "comm/process_group.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#if DTRAIN_HAS_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/internal/device_routed_backend.h"
#include "comm/internal/rendezvous.h"

namespace dtrain::comm {

bool nccl_available() { return DTRAIN_HAS_NCCL != 0; }

struct Group::State::Lifetime {
  std::atomic<bool> destroyed{false};
  std::mutex mu;
  std::vector<std::weak_ptr<State>> subgroups;  // made by new_group from this group
};

void destroy_process_group(const Group& group) {
  TORCH_CHECK(group.state_ != nullptr,
              "destroy_process_group: default-constructed Group; pass one made by "
              "init_process_group or new_group");
  // Every group of the tree is marked first (new_group from a marked group is refused under the
  // same lock), then each backend is shut down; one that throws does not keep the others up.
  std::vector<std::shared_ptr<Group::State>> marked, pending = {group.state_};
  while (!pending.empty()) {
    std::shared_ptr<Group::State> state = std::move(pending.back());
    pending.pop_back();
    std::lock_guard<std::mutex> lock(state->lifetime->mu);
    if (state->lifetime->destroyed.exchange(true)) continue;
    for (const auto& weak : state->lifetime->subgroups) {
      if (std::shared_ptr<Group::State> sub = weak.lock()) pending.push_back(std::move(sub));
    }
    state->lifetime->subgroups.clear();
    marked.push_back(std::move(state));
  }
  std::exception_ptr first_error;
  for (const auto& state : marked) {
    try {
      if (state->pg) shutdown_backend(*state->pg);
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (first_error) std::rethrow_exception(first_error);
}

c10::intrusive_ptr<c10d::Work> barrier(const Group& group, std::vector<int64_t> device_ids) {
  c10d::BarrierOptions opts;
  opts.timeout = group.timeout();
  opts.device = group.device();
  if (group.backend() == "nccl") {
    if (device_ids.empty()) device_ids.push_back(group.device().index());
#if DTRAIN_HAS_NCCL
    const int64_t visible = c10::cuda::device_count();
    for (int64_t id : device_ids) {
      TORCH_CHECK(id >= 0 && id < visible, "barrier: device id ", id,
                  " is not a GPU visible here (", visible,
                  " visible); pass this rank's GPU, Group::device() (cuda:",
                  static_cast<int>(group.device().index()), "), or no device_ids");
    }
#endif
    opts.device_ids = std::move(device_ids);
  }
  return group->barrier(opts);
}

const Group::State& Group::state() const {
  TORCH_CHECK(state_ != nullptr,
              "default-constructed Group: create one with init_process_group or new_group");
  return *state_;
}
const c10::intrusive_ptr<C10dGroup>& Group::pg() const {
  TORCH_CHECK(is_member(), "this rank is not a member of the group (world ranks ",
              state_ ? absl::StrJoin(state_->global_ranks, ",") : std::string("none"),
              "): only members may use it; check is_member() first");
  TORCH_CHECK(!state_->lifetime->destroyed.load(std::memory_order_relaxed),
              "this group (world ranks ", absl::StrJoin(state_->global_ranks, ","),
              ") was destroyed by destroy_process_group: create a new one with "
              "init_process_group or new_group");
  return state_->pg;
}
int Group::rank() const { return pg()->getRank(); }
int Group::size() const { return pg()->getSize(); }
const std::vector<int>& Group::global_ranks() const { return state().global_ranks; }
int Group::global_rank(int group_rank) const {
  const auto& ranks = global_ranks();
  TORCH_CHECK(group_rank >= 0 && group_rank < static_cast<int>(ranks.size()), "group rank ",
              group_rank, " is out of range for a group of ", ranks.size(), " ranks");
  return ranks[group_rank];
}
int Group::world_rank() const { return state().world_rank; }
int Group::local_rank() const { return state().local_rank; }
const std::string& Group::backend() const { return state().backend; }
c10::Device Group::device() const { return state().device; }
std::chrono::milliseconds Group::timeout() const { return state().timeout; }
const c10::intrusive_ptr<c10d::Store>& Group::store() const {
  pg();  // members only
  return state_->store;
}

const c10::intrusive_ptr<c10d::Store>& Group::root_store() const { return state().root_store; }

namespace {

constexpr char kDeviceRouted[] = "cpu:gloo,cuda:nccl";

// "gloo", "nccl", or one backend per device type ("cpu:gloo,cuda:nccl" in either order, as
// PyTorch spells it), in its canonical spelling.
absl::StatusOr<std::string> canonical_backend(const std::string& backend) {
  std::string b;
  for (char c : backend) {
    if (c != ' ') b += c;
  }
  if (b == "gloo" || b == "nccl" || b == kDeviceRouted || b == "cuda:nccl,cpu:gloo") {
    return b == "gloo" || b == "nccl" ? b : std::string(kDeviceRouted);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown backend \"", backend, "\": use \"gloo\", \"nccl\" or \"cpu:gloo,cuda:nccl\""));
}

absl::StatusOr<c10::intrusive_ptr<C10dGroup>> make_pg(const std::string& backend,
                                                      const c10::intrusive_ptr<c10d::Store>& store,
                                                      int rank, int size,
                                                      std::chrono::milliseconds timeout,
                                                      const std::string& bind_host, int threads,
                                                      bool blocking_wait = true) {
  if (backend ==
      kDeviceRouted) {  // Gloo for CPU tensors, NCCL for CUDA ones, each its own rendezvous
    auto cpu = make_pg("gloo", c10::make_intrusive<c10d::PrefixStore>("gloo", store), rank, size,
                       timeout, bind_host, threads, blocking_wait);
    if (!cpu.ok()) return cpu.status();
    auto cuda = make_pg("nccl", c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank, size,
                        timeout, bind_host, threads, blocking_wait);
    if (!cuda.ok()) return cuda.status();
    return internal::make_device_routed(*cpu, *cuda);
  }
  if (backend == "gloo") {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    try {
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      if (!bind_host.empty()) {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind_host));
      } else if (ifname != nullptr && *ifname != '\0') {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      } else {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("cannot create a Gloo device: ", e.what()));
    }
    opts->threads = std::max(1, threads);
    try {
      return c10::intrusive_ptr<C10dGroup>(
          c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts));
    } catch (const std::exception& e) {
      const std::string what = e.what();
      return absl::DeadlineExceededError(absl::StrCat(
          "gloo rendezvous of rank ", rank, " of ", size, " failed within ", timeout.count(),
          " ms: check that every rank started and reached this call (",
          what.substr(0, what.find('\n')), ")"));
    }
  }
  if (backend == "nccl") {
#if DTRAIN_HAS_NCCL
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout;
    // TORCH_NCCL_BLOCKING_WAIT is read when the group is made: a timed-out collective then throws
    // from wait() (naming it) instead of the watchdog tearing the process down.
    if (blocking_wait && std::getenv("TORCH_NCCL_BLOCKING_WAIT") == nullptr) {
      ::setenv("TORCH_NCCL_BLOCKING_WAIT", "1", 0);
    }
    try {
      return c10::intrusive_ptr<C10dGroup>(
          c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts));
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("cannot create the NCCL process group: ", e.what()));
    }
#else
    return absl::UnimplementedError(
        "backend \"nccl\" requested, but this dtrain was built against a CPU-only LibTorch (no "
        "libtorch_cuda.so under LIBTORCH_HOME); use backend \"gloo\", or rebuild with "
        "LIBTORCH_HOME pointing at a CUDA LibTorch");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend \"", backend, "\": use \"gloo\" or \"nccl\""));
}

// The device of an NCCL group: `device_id`, else LOCAL_RANK; made current, as PyTorch's
// init_process_group(device_id=...) does. Gloo groups keep their own tensors on the CPU, and so
// do groups with a backend per device type (object collectives over Gloo, as PyTorch's
// _get_object_coll_device picks the CPU where Gloo is), whose GPU is made current all the same.
absl::StatusOr<c10::Device> group_device(const std::string& backend, int device_id,
                                         int local_rank) {
  if (backend == "gloo") return c10::Device(c10::kCPU);
  const int index = device_id >= 0 ? device_id : local_rank;
#if DTRAIN_HAS_NCCL
  const int count = static_cast<int>(c10::cuda::device_count());
  if (index >= count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "backend \"nccl\": this rank's CUDA device is ", index,
        device_id >= 0 ? " (InitOptions::device_id)" : " (LOCAL_RANK)", " but ", count,
        " GPU(s) are visible; run at most one rank per GPU on each host, or set device_id or "
        "CUDA_VISIBLE_DEVICES"));
  }
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
#endif
  if (backend != "nccl") return c10::Device(c10::kCPU);
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

}  // namespace

void ignore_sigpipe() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  struct sigaction now {};
  if (::sigaction(SIGPIPE, nullptr, &now) != 0) return;
  if ((now.sa_flags & SA_SIGINFO) == 0 && now.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

absl::StatusOr<Group> init_process_group(const InitOptions& options) {
  absl::StatusOr<std::string> backend = canonical_backend(options.backend);
  if (!backend.ok()) return backend.status();
  if (*backend != "gloo" && !nccl_available()) {
    return make_pg("nccl", {}, 0, 1, options.timeout, "", 1).status();
  }
  if (options.timeout.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout must be positive, got ", options.timeout.count(), " ms"));
  }
  absl::StatusOr<internal::Rendezvous> rv = internal::rendezvous(options);
  if (!rv.ok()) return rv.status();
  ignore_sigpipe();

  auto state = std::make_shared<Group::State>();
  state->root_store = rv->store;
  state->prefix = "dtrain/world";
  state->store = c10::make_intrusive<c10d::PrefixStore>(state->prefix, rv->store);
  state->world_rank = rv->rank;
  state->global_ranks.resize(rv->world_size);
  for (int r = 0; r < rv->world_size; ++r) state->global_ranks[r] = r;
  state->backend = *backend;
  state->timeout = options.timeout;
  state->gloo_hostname = options.gloo_hostname.empty() ? rv->bind_host : options.gloo_hostname;
  state->gloo_threads = options.gloo_threads;
  if (const char* lr = std::getenv("LOCAL_RANK"); lr != nullptr && options.store == nullptr) {
    auto local = internal::parse_int("environment variable LOCAL_RANK", lr, 0, 1 << 20);
    if (!local.ok()) return local.status();
    state->local_rank = *local;
  }
  absl::StatusOr<c10::Device> device = group_device(*backend, options.device_id, state->local_rank);
  if (!device.ok()) return device.status();
  state->device = *device;
  state->nccl_blocking_wait = options.nccl_blocking_wait;
  state->lifetime = std::make_shared<Group::State::Lifetime>();
  auto pg =
      make_pg(*backend, c10::make_intrusive<c10d::PrefixStore>(state->prefix + "/pg", rv->store),
              rv->rank, rv->world_size, options.timeout, state->gloo_hostname, options.gloo_threads,
              options.nccl_blocking_wait);
  if (!pg.ok()) return pg.status();
  state->pg = *pg;
  Group g;
  g.state_ = std::move(state);
  return g;
}

absl::StatusOr<Group> new_group(const Group& parent, std::vector<int> ranks) {
  if (!parent.is_member()) {
    return absl::FailedPreconditionError(
        "new_group: this rank is not a member of the parent group; create subgroups from a group "
        "this rank belongs to (usually the world group)");
  }
  if (ranks.empty()) {
    return absl::InvalidArgumentError("new_group: the rank list is empty");
  }
  std::sort(ranks.begin(), ranks.end());
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= parent.size()) {
      return absl::InvalidArgumentError(absl::StrCat("new_group: rank ", ranks[i],
                                                     " is out of range for a parent group of ",
                                                     parent.size(), " ranks"));
    }
    if (i > 0 && ranks[i] == ranks[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("new_group: rank ", ranks[i], " is listed twice"));
    }
  }
  const Group::State& ps = *parent.state_;
  auto state = std::make_shared<Group::State>();
  // Every parent rank counts every new_group call, members or not, so names agree everywhere.
  state->prefix = absl::StrCat(ps.prefix, "/", parent.state_->children++);
  state->root_store = ps.root_store;
  state->world_rank = ps.world_rank;
  state->local_rank = ps.local_rank;
  state->backend = ps.backend;
  state->timeout = ps.timeout;
  state->gloo_hostname = ps.gloo_hostname;
  state->gloo_threads = ps.gloo_threads;
  state->device = ps.device;
  state->nccl_blocking_wait = ps.nccl_blocking_wait;
  for (int r : ranks) state->global_ranks.push_back(ps.global_ranks[r]);
  state->lifetime = std::make_shared<Group::State::Lifetime>();
  {  // destroy_process_group(parent) destroys this group too
    std::lock_guard<std::mutex> lock(ps.lifetime->mu);
    if (ps.lifetime->destroyed) {
      return absl::FailedPreconditionError(
          "new_group: the parent group was destroyed by destroy_process_group; make subgroups "
          "from a live group");
    }
    std::erase_if(ps.lifetime->subgroups, [](const auto& weak) { return weak.expired(); });
    ps.lifetime->subgroups.push_back(state);
  }
  Group g;
  const int me = parent.rank();
  auto it = std::find(ranks.begin(), ranks.end(), me);
  if (it == ranks.end()) {
    g.state_ = std::move(state);  // non-member: knows the members, has no process group
    return g;
  }
  state->store = c10::make_intrusive<c10d::PrefixStore>(state->prefix, ps.root_store);
  auto pg = make_pg(ps.backend,
                    c10::make_intrusive<c10d::PrefixStore>(state->prefix + "/pg", ps.root_store),
                    static_cast<int>(it - ranks.begin()), static_cast<int>(ranks.size()),
                    ps.timeout, ps.gloo_hostname, ps.gloo_threads, ps.nccl_blocking_wait);
  if (!pg.ok()) {
    return absl::Status(pg.status().code(), absl::StrCat("new_group(", absl::StrJoin(ranks, ","),
                                                         "): ", pg.status().message()));
  }
  state->pg = *pg;
  g.state_ = std::move(state);
  return g;
}

absl::StatusOr<Subgroups> new_subgroups(const Group& parent, int group_size) {
  if (!parent.is_member()) {
    return absl::FailedPreconditionError(
        "new_subgroups: this rank is not a member of the parent group");
  }
  if (group_size < 1 || group_size > parent.size()) {
    return absl::InvalidArgumentError(absl::StrCat("new_subgroups: group_size ", group_size,
                                                   " must be in [1, ", parent.size(), "]"));
  }
  if (parent.size() % group_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("new_subgroups: the group size ", parent.size(),
                                                   " is not divisible by group_size ", group_size));
  }
  std::vector<std::vector<int>> lists(parent.size() / group_size);
  for (int r = 0; r < parent.size(); ++r) lists[r / group_size].push_back(r);
  return new_subgroups_by_enumeration(parent, lists);
}

absl::StatusOr<Subgroups> new_subgroups_by_enumeration(
    const Group& parent, const std::vector<std::vector<int>>& ranks_per_subgroup) {
  if (!parent.is_member()) {
    return absl::FailedPreconditionError(
        "new_subgroups_by_enumeration: this rank is not a member of the parent group");
  }
  if (ranks_per_subgroup.empty()) {
    return absl::InvalidArgumentError("new_subgroups_by_enumeration: no subgroups given");
  }
  std::map<int, size_t> seen;
  for (size_t i = 0; i < ranks_per_subgroup.size(); ++i) {
    for (int r : ranks_per_subgroup[i]) {
      auto [it, inserted] = seen.emplace(r, i);
      if (!inserted && it->second != i) {
        return absl::InvalidArgumentError(
            absl::StrCat("Rank ", r, " has appeared in both subgroup ", it->second, " and ", i));
      }
    }
  }
  Subgroups out;
  for (const auto& ranks : ranks_per_subgroup) {
    absl::StatusOr<Group> g = new_group(parent, ranks);
    if (!g.ok()) return g.status();
    if (g->is_member()) out.mine = *g;
    out.all.push_back(*std::move(g));
  }
  return out;
}

}  // namespace dtrain::comm
