// Process groups on LibTorch's c10d, created the way torch.distributed.init_process_group does:
// Gloo on CPU (NCCL when the LibTorch found has CUDA), rendezvous through `env://` (torchrun's
// MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), `tcp://host:port` or `file://path`.
//
//   dtrain::comm::InitOptions options;            // backend "gloo", init_method "env://"
//   absl::StatusOr<dtrain::comm::Group> world = dtrain::comm::init_process_group(options);
//   if (!world.ok()) { std::cerr << world.status() << "\n"; return 1; }
//   std::vector<at::Tensor> t = {at::ones({4})};
//   (*world)->allreduce(t)->wait();               // C10dGroup API through ->
//   absl::StatusOr<dtrain::comm::Group> pair = dtrain::comm::new_group(*world, {0, 1});
#ifndef DTRAIN_COMM_PROCESS_GROUP_H_
#define DTRAIN_COMM_PROCESS_GROUP_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "absl/status/statusor.h"
#include "comm/libtorch_compat.h"

namespace dtrain::comm {

class ByteCounter;  // comm/testing/counting_group.h

// True when this build has the NCCL backend (the LibTorch found at build time ships CUDA).
bool nccl_available();

struct InitOptions {
  // "gloo" (CPU tensors; CUDA tensors too, through the host), "nccl" (CUDA tensors; only in builds
  // where nccl_available()), or "cpu:gloo,cuda:nccl" -- PyTorch's default where CUDA is available:
  // one group whose collectives go to Gloo for CPU tensors and to NCCL for CUDA tensors (each
  // backend keeps its own order; barrier() is Gloo's). Group::backend() is the canonical spelling.
  std::string backend = "gloo";
  // "env://" | "tcp://HOST:PORT" | "file:///PATH". tcp:// and file:// may carry
  // "?rank=R&world_size=W" as in PyTorch. Ignored when `store` is set.
  std::string init_method = "env://";
  // This process's rank and the number of ranks; -1 means "from RANK / WORLD_SIZE" (env://, or
  // the URL query). Explicit values win over the environment, as in PyTorch.
  int rank = -1;
  int world_size = -1;
  // Rendezvous and collective timeout (PyTorch's default: 30 minutes). A collective that does not
  // complete in this time throws instead of hanging.
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  // Deadline of the whole rendezvous (reaching the master, every rank arriving, WORLD_SIZE agreeing)
  // when it should differ from `timeout`; 0: `timeout`.
  std::chrono::milliseconds rendezvous_timeout{0};
  // Rendezvous store to use instead of `init_method` (e.g. a c10d::HashStore shared by ranks that
  // run as threads of one process).
  c10::intrusive_ptr<c10d::Store> store;
  // Address Gloo binds to. Empty: GLOO_SOCKET_IFNAME if set, else 127.0.0.1 when the master is on
  // loopback (or the store is in-process), else this host's resolved address.
  std::string gloo_hostname;
  // Gloo worker threads: how many collectives of this group can progress at once.
  int gloo_threads = 2;
  // The CUDA device of this rank (PyTorch's init_process_group(device_id=...)): the device an NCCL
  // group runs on and puts the tensors dtrain makes itself (object collectives, flags, sizes) on.
  // -1: LOCAL_RANK (as torchrun sets it; 0 when unset). init_process_group makes it the current
  // CUDA device. Ignored by Gloo groups, whose own tensors stay on the CPU (Gloo also reduces CUDA
  // tensors a caller passes). An index >= the number of visible GPUs is InvalidArgument.
  int device_id = -1;
  // NCCL only: a collective that has not finished within `timeout` makes Work::wait() throw an
  // error naming it (PyTorch's TORCH_NCCL_BLOCKING_WAIT=1) instead of NCCL's watchdog aborting the
  // process. An explicit TORCH_NCCL_BLOCKING_WAIT in the environment wins.
  bool nccl_blocking_wait = true;
};

// A c10d process group with what torch.distributed keeps beside it: the store it rendezvoused on,
// the world ranks of its members and its timeout. Cheap to copy (shared state). Thread safety: the
// c10d group is thread-safe for issuing collectives; new_group() on one Group must be called from
// one thread at a time, in the same order on every rank.
class Group {
 public:
  Group() = default;

  // False for a default Group and for the value new_group() returns on ranks outside the group.
  bool is_member() const { return state_ != nullptr && state_->pg != nullptr; }
  explicit operator bool() const { return is_member(); }

  // REQUIRES: is_member().
  const c10::intrusive_ptr<C10dGroup>& pg() const;
  C10dGroup* operator->() const { return pg().get(); }
  int rank() const;  // rank inside this group
  int size() const;

  // World ranks of this group's members, by group rank (PyTorch's get_process_group_ranks).
  const std::vector<int>& global_ranks() const;
  // PyTorch's _get_global_rank(group, group_rank).
  int global_rank(int group_rank) const;
  // This process's rank in the world group; LOCAL_RANK (0 when unset).
  int world_rank() const;
  int local_rank() const;

  const std::string& backend() const;
  // Where this group's collectives want the tensors dtrain creates for them (sizes, flags, object
  // bytes, norms): cuda:<device_id> for an NCCL group, the CPU otherwise ("cpu:gloo,cuda:nccl"
  // included: those go over Gloo, as PyTorch's object collectives do there). Valid on non-members.
  c10::Device device() const;
  std::chrono::milliseconds timeout() const;
  // This group's own namespace of the rendezvous store (for control-plane exchanges that must not
  // collide with other groups').
  const c10::intrusive_ptr<c10d::Store>& store() const;
  // The rendezvous store itself, shared by every group of the job (comm/heartbeat.h's counters).
  const c10::intrusive_ptr<c10d::Store>& root_store() const;

 private:
  struct State {
    c10::intrusive_ptr<C10dGroup> pg;
    c10::intrusive_ptr<c10d::Store> root_store;  // unprefixed rendezvous store
    c10::intrusive_ptr<c10d::Store> store;       // prefixed for this group
    std::string prefix;
    std::vector<int> global_ranks;
    int world_rank = 0;
    int local_rank = 0;
    std::string backend;
    std::chrono::milliseconds timeout{0};
    std::string gloo_hostname;
    int gloo_threads = 2;
    c10::Device device = c10::Device(c10::kCPU);
    bool nccl_blocking_wait = true;
    int64_t children = 0;  // subgroups created from this group (names them)
    struct Lifetime;       // destroyed yet, and the subgroups destroyed with it (process_group.cc)
    std::shared_ptr<Lifetime> lifetime;
  };
  std::shared_ptr<State> state_;
  const State& state() const;  // TORCH_CHECKs that the Group was initialised

  friend absl::StatusOr<Group> init_process_group(const InitOptions& options);
  friend absl::StatusOr<Group> new_group(const Group& parent, std::vector<int> ranks);
  friend Group counting_group(const Group& group, std::shared_ptr<ByteCounter> counter);
  friend void destroy_process_group(const Group& group);
};

// Rendezvous and create the world group. Blocks until all world_size ranks have joined or the
// timeout passes. Errors:
//   InvalidArgument  unknown backend or init method, bad URL, rank >= world_size, a malformed
//                    RANK/WORLD_SIZE/MASTER_PORT (the message names the variable);
//   NotFound         an env:// variable that is not set (named, with what sets it);
//   Unimplemented    backend "nccl" or "cpu:gloo,cuda:nccl" in a build without CUDA;
//   DeadlineExceeded the master (named host:port) unreachable or peers missing within the timeout;
//   Unavailable      the master port cannot be bound, other transport failures.
absl::StatusOr<Group> init_process_group(const InitOptions& options);

// Shuts down `group`'s backends (NCCL's communicators, as torch.distributed.destroy_process_group
// does) and every group created from it with new_group/new_subgroups, directly or not: for the
// world group, every group of the job, as PyTorch's destroy_process_group() of the default group.
// Afterwards whatever needs their process group -- collectives, rank(), size(), new_group -- on
// them or on copies of them fails saying they were destroyed (what is only recorded, such as
// global_ranks(), stays readable). Local, not collective; wait for the collectives you issued
// first. Every backend is shut down even if one throws (the first error is rethrown). Calling
// it again is a no-op; a non-member's Group is only marked. Thread-safe, also against new_group. An NCCL group left undestroyed at exit
// makes PyTorch 2.x warn "destroy_process_group() was not called before program exit".
// REQUIRES: `group` was made by init_process_group or new_group.
void destroy_process_group(const Group& group);

// torch.distributed.barrier(group, device_ids=...): returns the barrier's Work; its wait() returns
// once every member has called barrier. An NCCL group runs it on `device_ids` (GPU indices visible
// here), by default the group's device -- PyTorch uses the device a group was bound to and, with
// none, guesses the current one with a warning that a wrong guess can hang -- and a device id
// that is not a visible GPU is a TORCH_CHECK failure naming it. Other groups ignore `device_ids`,
// as PyTorch's Gloo does ("cpu:gloo,cuda:nccl" included: its barrier is Gloo's). Timeout: the
// group's. REQUIRES: group.is_member(); collective over the group.
c10::intrusive_ptr<c10d::Work> barrier(const Group& group, std::vector<int64_t> device_ids = {});

// Only the rendezvous of init_process_group (the store, this rank, the world size), for layers
// that bring their own transport (rpc/'s TensorPipe agent). Same options and errors; `backend`
// and the Gloo fields are ignored.
struct RendezvousResult {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = -1;
  int world_size = -1;
};
absl::StatusOr<RendezvousResult> rendezvous_store(const InitOptions& options);

// A write to a peer that has died raises SIGPIPE, whose default action kills the writer silently
// (exit by signal 13, no message). init_process_group and rpc's agent call this, so such a write
// fails the collective or call with an error instead, as in Python (which ignores SIGPIPE at
// startup). A handler the program installed itself is left alone. Idempotent and thread-safe.
void ignore_sigpipe();

// A group of some of `parent`'s ranks (parent ranks, any order, no duplicates), as
// torch.distributed.new_group. Collective over `parent`: every parent rank calls it with the same
// ranks, in the same order relative to its other new_group calls. Non-members get a Group with
// is_member() == false (and global_ranks() of the members). Members block until all members join.
absl::StatusOr<Group> new_group(const Group& parent, std::vector<int> ranks);

struct Subgroups {
  Group mine;              // this rank's subgroup (is_member() false if it is in none)
  std::vector<Group> all;  // every subgroup, in creation order; members only on their ranks
};

// Consecutive subgroups of `group_size` ranks ([0..g-1], [g..2g-1], ...), as
// torch.distributed.new_subgroups. REQUIRES parent.size() % group_size == 0. Collective over parent.
absl::StatusOr<Subgroups> new_subgroups(const Group& parent, int group_size);

// Subgroups given by rank lists, as torch.distributed.new_subgroups_by_enumeration: a rank may be
// in at most one subgroup. Collective over parent.
absl::StatusOr<Subgroups> new_subgroups_by_enumeration(
    const Group& parent, const std::vector<std::vector<int>>& ranks_per_subgroup);

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_PROCESS_GROUP_H_
