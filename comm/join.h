// Uneven inputs across ranks, as torch.distributed.algorithms.join: ranks that run out of data
// keep shadowing the collectives of the ranks still working, until every rank is done.
//
//   class MyJoinable : public dtrain::comm::Joinable { ... };   // join_hook(), join_process_group()
//   MyJoinable model(group);
//   dtrain::comm::Join join({&model});        // like `with Join([model]):`
//   for (auto& batch : my_batches) {          // each rank may have a different count
//     model.step(batch);                      // calls Join::notify_join_context(model) first
//   }
//   join.finish();                            // shadows the others' steps until all are done
//
// A Joinable calls Join::notify_join_context(*this) at the start of each of its per-iteration
// collectives; its JoinHook::main_hook() then mirrors that iteration's collectives on a joined
// rank, and post_hook(is_last_joiner) runs once at the end on every rank.
#ifndef DTRAIN_COMM_JOIN_H_
#define DTRAIN_COMM_JOIN_H_

#include <memory>
#include <vector>

#include <c10/core/Device.h>
#include "comm/libtorch_compat.h"

namespace dtrain::comm {

// What a joined rank runs in place of the work it no longer has.
class JoinHook {
 public:
  virtual ~JoinHook() = default;
  // Shadows one iteration of the non-joined ranks' collectives.
  virtual void main_hook() {}
  // Runs once all ranks have joined; is_last_joiner is true on the rank(s) that joined last.
  virtual void post_hook(bool is_last_joiner) {}
};

// Options passed to every join hook (PyTorch's **kwargs to Join).
struct JoinOptions {
  bool enable = true;
  // Instead of shadowing, throw on every rank as soon as one rank runs out of inputs.
  bool throw_on_early_termination = false;
  // Whether DDP's join hook divides gradients by the initial world size (PyTorch's
  // divide_by_initial_world_size); interpreted by each Joinable.
  bool divide_by_initial_world_size = true;
};

class Joinable {
 public:
  virtual ~Joinable() = default;
  virtual std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) = 0;
  virtual c10::Device join_device() const = 0;
  virtual c10::intrusive_ptr<C10dGroup> join_process_group() const = 0;

 protected:
  // True while this joinable is inside an enabled Join context (its forward must then mirror
  // the join protocol's per-iteration collectives).
  bool join_enabled() const { return join_enabled_; }

 private:
  friend class Join;
  // Set by Join: only the first joinable of a context does the per-iteration all-reduce.
  bool join_enabled_ = false;
  bool is_first_joinable_ = false;
  bool throw_on_early_termination_ = false;
};

// The join context manager. Construction is `__enter__`; finish() is `__exit__` for a body that
// completed normally: call it on every rank after its last input. If the body throws, skip
// finish() (as PyTorch does on an exception). Not thread-safe; one Join per joinable at a time.
class Join {
 public:
  // REQUIRES: joinables non-empty, all on the same process group and device.
  explicit Join(std::vector<Joinable*> joinables, JoinOptions options = {});
  ~Join();
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  // Collective over the joinables' group: repeats every hook's main_hook() while any rank still
  // works, then runs post_hook(is_last_joiner). With throw_on_early_termination, signals the
  // other ranks and throws "Rank R exhausted all inputs." instead.
  void finish();

  // Called by a Joinable before its per-iteration collectives. Returns the pending all-reduce
  // that counts the non-joined ranks (null when this is not the first joinable or join is
  // disabled); throws on every rank when throw_on_early_termination and some rank has joined.
  static c10::intrusive_ptr<c10d::Work> notify_join_context(Joinable& joinable);

 private:
  int num_nonjoined_procs();
  void notify_procs_to_terminate();

  std::vector<Joinable*> joinables_;
  std::vector<std::unique_ptr<JoinHook>> hooks_;
  JoinOptions options_;
  c10::intrusive_ptr<C10dGroup> process_group_;
  c10::Device device_ = c10::Device(c10::kCPU);
  bool finished_ = false;
};

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_JOIN_H_
