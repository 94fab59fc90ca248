// ZeroRedundancyOptimizer: PyTorch's ZeRO stage 1 for LibTorch. Wraps a local optimizer and
// shards optimizer state across the ranks of a group: each rank's local optimizer holds only the
// parameters it owns (PyTorch's sorted-greedy partition), steps them, and the updated
// parameters are then broadcast from their owners. It is itself a torch::optim::Optimizer.
//
//   dtrain::optim::ZeroOptions zero_options;
//   zero_options.group = world;                             // a comm::Group
//   zero_options.parameters_as_bucket_view = true;
//   dtrain::optim::ZeroRedundancyOptimizer opt(
//       model->parameters(),
//       dtrain::optim::local_optimizer<dtrain::optim::FunctionalOptimizerAdapter>("Adam", adam_options),
//       zero_options);
//   ... loss.backward(); (gradients averaged by DDP) ...
//   opt.step();                                             // local step + parameter sync
//   opt.consolidate_state_dict(/*to=*/0);                   // collective
//   if (rank == 0) save(opt.state_dict());                  // global, PyTorch's format
//   // Or without gathering anything on one rank: every rank writes its own shard, and any
//   // world size or strategy reads back the pieces it owns.
//   absl::Status s = opt.save_sharded("/ckpt/zero");        // collective
//   absl::StatusOr<c10::IValue> extra = opt.load_sharded("/ckpt/zero");
//
// With a functional local optimizer (through FunctionalOptimizerAdapter), step() updates the
// shard in chunks and starts each chunk's broadcast as soon as it is updated, overlapping the
// parameter sync with the optimizer's own work.
//
// Collectives: the constructor, step(), add_param_group() and consolidate_state_dict() must be
// called by every rank of the group, in the same order. Not thread-safe (as torch::optim).
#ifndef DTRAIN_OPTIM_ZERO_ZERO_REDUNDANCY_OPTIMIZER_H_
#define DTRAIN_OPTIM_ZERO_ZERO_REDUNDANCY_OPTIMIZER_H_

#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/optim/optimizer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/optimizer_state_dict.h"
#include "checkpoint/sharded.h"
#include "comm/join.h"
#include "comm/process_group.h"
#include "optim/functional/adapter.h"
#include "optim/zero/options.h"
#include "partition/sorted_greedy.h"

namespace dtrain::optim {

namespace internal {
class ZeroAccess;
class ZeroLayout;
}  // namespace internal

// Builds this rank's local optimizer over its parameter groups; `defaults` are the options of
// groups that bring none (and the wrapper's defaults).
struct LocalOptimizer {
  std::function<std::unique_ptr<torch::optim::Optimizer>(
      std::vector<torch::optim::OptimizerParamGroup>)>
      make;
  std::unique_ptr<torch::optim::OptimizerOptions> defaults;
  // The functional optimizer's registry name (local_optimizer<Adapter>(name, ...)); empty for a
  // LibTorch type. Lets the constructor refuse a partition the optimizer's math cannot take.
  std::string functional_name;
};

// A LibTorch optimizer type as the local optimizer: local_optimizer<torch::optim::Adam>(AdamOptions(1e-3)).
template <typename OptimizerT, typename OptionsT>
LocalOptimizer local_optimizer(OptionsT defaults) {
  LocalOptimizer l;
  l.defaults = std::make_unique<OptionsT>(defaults);
  l.make = [defaults](std::vector<torch::optim::OptimizerParamGroup> groups) {
    return std::unique_ptr<torch::optim::Optimizer>(
        std::make_unique<OptimizerT>(std::move(groups), defaults));
  };
  return l;
}

// A functional optimizer (built-in or registered) as the local optimizer, through the adapter:
// local_optimizer<FunctionalOptimizerAdapter>("Adam", options_dict).
template <typename Adapter>
LocalOptimizer local_optimizer(const std::string& name, const OptionsDict& defaults) {
  LocalOptimizer l;
  l.defaults = std::make_unique<DictOptions>(defaults.copy());
  l.functional_name = name;
  l.make = [name, defaults](std::vector<torch::optim::OptimizerParamGroup> groups) {
    return std::unique_ptr<torch::optim::Optimizer>(
        std::make_unique<Adapter>(std::move(groups), name, defaults.copy()));
  };
  return l;
}

// The same with the options written in place, as Python's keyword arguments:
// local_optimizer<FunctionalOptimizerAdapter>("Adam", {{"lr", 1e-3}, {"betas", betas}}).
// A key given twice is an error (c10::Error), as a repeated keyword argument is in Python.
template <typename Adapter>
LocalOptimizer local_optimizer(const std::string& name,
                               std::initializer_list<std::pair<std::string, c10::IValue>> options) {
  OptionsDict defaults = new_options_dict();
  for (const auto& [key, value] : options) {
    TORCH_CHECK(!defaults.contains(key), "local_optimizer(\"", name, "\", ...): option '", key,
                "' is given twice; give each option once");
    defaults.insert(key, value);
  }
  return local_optimizer<Adapter>(name, defaults);
}

class ZeroRedundancyOptimizer : public torch::optim::Optimizer, public comm::Joinable {
 public:
  // Collective. Errors (c10::Error, PyTorch's wording): empty parameter list; sparse or mixed
  // dtype parameters ("only supports using the same dense type for all parameters"); an invalid
  // manual partition; a group that is not a member.
  ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                          LocalOptimizer local, ZeroOptions options);
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, LocalOptimizer local,
                          ZeroOptions options);
  ~ZeroRedundancyOptimizer() override;

  // Collective: this rank's local step (closure evaluated there), then every parameter is
  // synchronised from its owner (broadcasts issued asynchronously, waited once). Returns the
  // closure's loss.
  at::Tensor step(LossClosure closure = nullptr) override;

  // Collective: adds a group on every rank, partitions its parameters and rebuilds the buckets.
  // A call on only some ranks fails on every rank within the group's timeout (the callers here,
  // the others at their next step) with "add_param_group must be called on all ranks".
  // Note: torch::optim::Optimizer::add_param_group is not virtual; call this one on the ZeRO type.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  // Collective: gathers every rank's shard of the optimizer state onto rank `to` of the group.
  void consolidate_state_dict(int to = 0);
  // On the rank that received consolidate_state_dict: the global state in PyTorch's optimizer
  // format (global parameter indices), as the unsharded local optimizer would return it; every
  // parameter is listed in its group, including any a manual partition gave to no rank.
  // Elsewhere, or without consolidation, a clear error; after a later step() also an error
  // (PyTorch returns the stale state, which a checkpoint would pair with newer parameters).
  c10::IValue state_dict() const;
  // Loads this rank's part of a global state dict (from state_dict() here, from an unsharded
  // optimizer, or saved at another world size) into the local optimizer, and the groups' options.
  // Not a collective. Every rank checks the whole dict against every parameter before anything
  // changes -- as FunctionalOptimizer::load_state_dict checks its own: "params" holding each index
  // once, finite options, "step" a whole number >= 0, the slots the optimizer keeps, shapes,
  // floating dtypes, finite values; for a LibTorch local optimizer the step, shapes, dtypes and
  // finiteness (optim/functional/state_checks.h) -- so every rank refuses a bad dict with the
  // same message, naming the key and the parameter's index in the dict.
  // Errors (c10::Error, one line): those; state for a parameter index outside [0, parameters)
  // (PyTorch: IndexError).
  void load_state_dict(const c10::IValue& state_dict);

  // Sharded checkpoints (checkpoint/sharded.h), with no rank holding more than its own shard.
  // save_sharded: collective; writes this rank's shard of the optimizer state (whole parameters,
  // or element ranges with kFlat) and, from rank 0, the param groups and `extra` (user metadata
  // such as the step) into the existing directory `dir`. Errors: the first failing rank's I/O
  // error, on every rank.
  absl::Status save_sharded(const std::string& dir, const c10::IValue& extra = c10::IValue());
  // Not collective: reads the pieces this rank owns now (any saved world size or strategy) and
  // loads them with the groups' options, as load_state_dict does. Returns the saved `extra`.
  // Errors: load_sharded's (NotFound, FailedPrecondition for an unfinished save, DataLoss);
  // InvalidArgument when the checkpoint's parameter count, shapes or group count differ from
  // this optimizer's.
  absl::StatusOr<c10::IValue> load_sharded(const std::string& dir);
  // The parts of the two above, for callers that bring their own storage: this rank's shard
  // (param groups included on every rank), the pieces it owns (global index -> element range),
  // and loading a state holding exactly those pieces (a piece may be missing: no state yet).
  checkpoint::ShardedState sharded_state();
  std::map<int64_t, partition::Range> owned_ranges() const;
  void load_sharded_state(const checkpoint::ShardedState& state);

  // comm::Joinable (PyTorch's _ZeROJoinHook): a rank out of inputs keeps calling step() in the
  // join hook, so its shard is still updated and broadcast while other ranks train on.
  std::unique_ptr<comm::JoinHook> join_hook(const comm::JoinOptions& options) override;
  c10::Device join_device() const override;
  c10::intrusive_ptr<comm::C10dGroup> join_process_group() const override;

  // torch.nn.utils.clip_grad_norm_ over the gradients step() will use: scales them by
  // max_norm / (total_norm + 1e-6) when that is below 1 and returns the total norm (a 0-dim
  // tensor) of every parameter's gradient taken together. With shard_gradients the norm is summed
  // over the ranks' slices (one all-reduce of a scalar; collective); otherwise every rank holds
  // every (DDP-averaged) gradient and nothing is communicated. norm_type: p > 0 or infinity.
  // Errors: a non-finite total norm with error_if_nonfinite (as PyTorch).
  at::Tensor clip_grad_norm_(double max_norm, double norm_type = 2.0,
                             bool error_if_nonfinite = false);
  bool shard_gradients() const { return options_.shard_gradients; }
  // Bytes of gradient this rank holds for the step: its slices with shard_gradients, else the
  // parameters' .grad tensors.
  int64_t gradient_bytes() const;

  // Every parameter, in global order (groups concatenated).
  const std::vector<at::Tensor>& parameters() const;
  // PyTorch's overlap_with_ddp: the steps run in ddp_hooks' ZeRO overlap hook, through
  // optim/zero/overlap.h (visible to ddp_hooks only); ZeRO-2's through optim/zero/grad_shards.h.
  bool overlap_with_ddp() const { return options_.overlap_with_ddp; }

  // Introspection. With kFlat, partition().numel_per_rank holds each rank's range size and
  // owner[i] is the rank holding parameter i's first element.
  const partition::ParamPartition& partition() const;
  torch::optim::Optimizer& local_optimizer() { return *local_; }
  const comm::Group& process_group() const { return options_.group; }
  int rank() const { return options_.group.rank(); }
  int world_size() const { return options_.group.size(); }
  // Bytes of tensors in this rank's optimizer state (what sharding divides by the world size).
  int64_t local_state_bytes();

 private:
  // The one door for its extensions (overlap.h, grad_shards.h): internal/access.h.
  friend class internal::ZeroAccess;
  class JoinStep;  // join_hook()'s hook: shadows the steps of the ranks still training
  // step() without its error translation.
  at::Tensor step_unchecked(LossClosure closure);
  void init(std::vector<torch::optim::OptimizerParamGroup> param_groups);
  void validate_params() const;
  // The layout of options_.strategy (and options_.params_per_rank) over param_groups_.
  void build_layout();
  void build_local_optimizer();
  void sync_options(bool to_local);
  void check_add_param_group_agreement(bool calling);
  // The local optimizer's state dict, with the wrapper's group options.
  c10::IValue synced_local_state_dict();
  // Loads a local dict (local index k: layout_->entries()[k], the file's parameter file_index[k]).
  void load_local_state(const std::vector<checkpoint::ParamGroup>& groups,
                        std::map<int64_t, checkpoint::StateEntry> local_state,
                        const std::vector<int64_t>& file_index);

  LocalOptimizer local_factory_;
  ZeroOptions options_;
  // Which entries this rank holds, its local groups, the broadcast plan (optim/zero/internal/layout.h).
  std::unique_ptr<internal::ZeroLayout> layout_;
  std::unique_ptr<torch::optim::Optimizer> local_;
  c10::IValue consolidated_;
  bool stale_consolidation_ = false;  // a step ran after this rank received a consolidation
  std::string store_prefix_;
  int64_t add_param_group_calls_ = 0;
  // Set while the join hook shadows a step: that step must not count itself as a rank with
  // inputs (PyTorch's hook does, which breaks ZeRO as the first or only joinable).
  bool in_join_hook_ = false;
  bool stepped_ = false;
  bool state_loaded_ = false;  // load_state_dict or load_sharded ran
  // shard_gradients: global parameter indices per DDP bucket, set by the ZeRO-2 hook.
  std::vector<std::vector<int64_t>> grad_shard_buckets_;
};

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_ZERO_ZERO_REDUNDANCY_OPTIMIZER_H_
