// DistributedDataParallel for LibTorch modules: gradients are averaged across ranks in buckets
// whose all-reduce starts during backward, as soon as the bucket's last gradient is ready
// (autograd post-hooks on the parameters' gradient accumulators), overlapping communication
// with the rest of backward; the end of backward waits for every bucket and writes the averaged
// gradients back. Communication goes through c10d::CommHookInterface hooks.
//
//   dtrain::ddp_hooks::DDPOptions options;
//   options.group = world;
//   dtrain::ddp_hooks::DistributedDataParallel ddp(model, options);   // broadcasts rank 0's weights
//   for (auto& batch : data) {
//     optimizer.zero_grad();
//     at::Tensor loss = ddp.forward([&] { return loss_fn(model->forward(batch.x), batch.y); });
//     loss.backward();                                          // gradients averaged on return
//     optimizer.step();
//   }
//   { auto guard = ddp.no_sync(); ddp.forward(...).backward(); }   // accumulate locally
//
// Every rank must run the same forward/backward sequence (collectives). One engine per module.
// Not thread-safe across concurrent backward passes of the same module.
#ifndef DTRAIN_DDP_HOOKS_DISTRIBUTED_DATA_PARALLEL_H_
#define DTRAIN_DDP_HOOKS_DISTRIBUTED_DATA_PARALLEL_H_

#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include "comm/join.h"
#include "comm/process_group.h"

namespace dtrain::ddp_hooks {

struct DDPOptions {
  comm::Group group;               // required
  double bucket_cap_mb = 25;       // MiB per bucket (PyTorch's bucket_cap_mb)
  double first_bucket_cap_mb = 1;  // the first bucket of each dtype, so communication starts early
  bool broadcast_buffers = true;   // broadcast rank 0's buffers before each forward
  // Parameters that get no gradient in an iteration count as ready with zero gradient; those
  // unused on every rank keep their .grad untouched. Without it, a parameter without gradient
  // is an error at the next forward, naming it (as PyTorch).
  bool find_unused_parameters = false;
  // .grad of every parameter is a view into its bucket (no copy in or out of the buckets).
  bool gradient_as_bucket_view = false;
  // The set of used parameters is the same every iteration (accepted for PyTorch parity; the
  // engine needs no extra work for it).
  bool static_graph = false;
};

// Implemented by a communication hook that cannot serve a joined rank's shadow backward (it would
// act on the zero gradients a joined rank contributes, e.g. step an optimizer with them):
// DistributedDataParallel::join_hook then refuses on every rank, with this reason.
class NotJoinable {
 public:
  virtual ~NotJoinable() = default;
  virtual std::string why_not_joinable() const = 0;
};

// Implemented by a communication hook that takes each bucket's gradients over instead of handing
// them back (ZeRO-2's, ddp_hooks/zero_hook.h): DDP then fills each bucket in a buffer that lives
// only while the hook holds it, releases a parameter's .grad once it is copied in, writes nothing
// back (after a synchronised backward the parameters have no .grad), and calls finish_backward()
// at the end of every synchronised backward, a joined rank's shadow backward included, after the
// last bucket went to the hook. Such a hook rules out gradient_as_bucket_view and
// find_unused_parameters (register_comm_hook says so).
class GradientConsumer {
 public:
  virtual ~GradientConsumer() = default;
  virtual void finish_backward() = 0;
};

class DistributedDataParallel : public comm::Joinable {
 public:
  // Collective. Checks every rank has the same parameter names, shapes and dtypes (an error
  // naming the first difference, instead of a hang or silent corruption), broadcasts rank 0's
  // parameters and buffers, builds the buckets and registers the autograd hooks.
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, DDPOptions options);
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Runs `forward` (the module's forward pass and loss) after DDP's pre-forward work: the error
  // for parameters that got no gradient last iteration, and the buffer broadcast.
  template <typename F>
  auto forward(F&& forward) -> decltype(forward()) {
    pre_forward();
    return forward();
  }

  // Replaces the default all-reduce. Once per engine: a second call is an error. A
  // GradientConsumer hook needs gradient_as_bucket_view and find_unused_parameters off.
  void register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook);

  // While alive, backward passes accumulate gradients locally without communication.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallel* ddp);
    ~NoSyncGuard();
    NoSyncGuard(NoSyncGuard&& other) noexcept;
    NoSyncGuard(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel* ddp_;
    bool previous_;
  };
  NoSyncGuard no_sync();

  // comm::Joinable (PyTorch's _DDPJoinHook): a rank out of inputs shadows the others' buffer
  // broadcasts and gradient all-reduces (contributing zeros; gradients stay divided by the
  // initial world size), and at the end every rank takes the model of the last rank to join.
  // With JoinOptions::divide_by_initial_world_size=false the default all-reduce averages over
  // the ranks still training instead (custom hooks keep their own division, as in PyTorch).
  // Errors (c10::Error): the registered hook is NotJoinable (e.g. the ZeRO overlap hook).
  std::unique_ptr<comm::JoinHook> join_hook(const comm::JoinOptions& options) override;
  c10::Device join_device() const override;
  c10::intrusive_ptr<comm::C10dGroup> join_process_group() const override;

  torch::nn::Module& module() { return *module_; }
  // Parameter indices (registration order) per bucket, in reduction order.
  std::vector<std::vector<size_t>> bucket_indices() const;
  const std::vector<std::string>& parameter_names() const;
  // The parameters DDP reduces (those requiring grad, registration order).
  const std::vector<at::Tensor>& parameters() const;
  // The group the gradients are reduced over (DDPOptions::group).
  const comm::Group& group() const;

  struct State;  // shared with the autograd hooks

 private:
  void pre_forward();
  void sync_buffers();
  void shadow_backward();
  void sync_final_model(bool is_last_joiner);
  friend class DDPJoinHook;

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<State> state_;
};

}  // namespace dtrain::ddp_hooks

#endif  // DTRAIN_DDP_HOOKS_DISTRIBUTED_DATA_PARALLEL_H_
