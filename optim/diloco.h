// DiLoCo (arXiv 2311.08105; torchft's DiLoCo): every rank runs H inner optimizer steps alone; then
// the ranks all-reduce the pseudo-gradient (the global parameters of the last round minus the
// local ones now), an outer optimizer -- Nesterov SGD, lr 0.7, momentum 0.9 by default -- applies
// it to the global parameters, and every rank continues from the new global parameters. With
// `fragments` > 1 it is Streaming DiLoCo (arXiv 2501.18512): the parameters are cut into
// fragments that synchronise in turn; with `fragment_sync_delay` > 0 a fragment's all-reduce runs
// while the next inner steps do, and `fragment_update_alpha` mixes the local parameters into the
// new global ones. Itself a torch::optim::Optimizer, in the PostLocalSGD family.
//
//   auto inner = std::make_unique<torch::optim::AdamW>(model->parameters(),
//                                                     torch::optim::AdamWOptions(4e-4));
//   dtrain::optim::DiLoCoOptions options;
//   options.group = world;              // required: the ranks that average pseudo-gradients
//   options.sync_every = 500;           // H
//   dtrain::optim::DiLoCo opt(std::move(inner), options);
//   for (...) { opt.zero_grad(); loss.backward(); opt.step(); }   // every 500th step syncs
//   c10::IValue sd = opt.state_dict();  // the inner optimizer's, plus "diloco" (see state_dict)
//
// Fault-tolerant, as torchft's Manager (DiLoCoOptions::quorum; comm/quorum.h): replica groups
// agree on a quorum at every sync, a lost one is dropped after join_timeout and the others commit
// the round among themselves; a process restarted in its place gets the state from a peer:
//
//   comm::QuorumOptions q;                       // the job runs a comm::Lighthouse somewhere
//   q.lighthouse_host = host; q.lighthouse_port = port; q.replica_id = id; q.min_replicas = 2;
//   dtrain::optim::DiLoCoOptions options;        // no group: each quorum brings its own
//   options.quorum = std::move(*dtrain::comm::QuorumClient::connect(q));
//   dtrain::optim::DiLoCo opt(std::move(inner), options);
//   opt.join_quorum();                           // at start, and in a restarted replica
//   for (...) { opt.zero_grad(); loss.backward(); opt.step(); }
//
// The options (DiLoCoOptions; each with its meaning, range and conflicts there), with defaults:
//   group (required unless quorum), sync_every = 500, outer_optimizer = "SGD",
//   outer_options = default_outer_options() ({"lr": 0.7, "momentum": 0.9, "nesterov": true}),
//   fragments = 1, outer_compression = "none", fragment_sync_delay = 0 (the sync blocks),
//   fragment_update_alpha = 0.0 (local parameters replaced by the global ones), quorum = null (no
//   fault tolerance), max_quorum_retries = 5.
//
// REQUIRES: every rank of the group starts with equal parameters (seed the model alike, or
// broadcast them) and steps the same number of times; DiLoCo checks neither.
// Thread safety: none (as torch::optim). Param groups: the inner optimizer's, as in
// PostLocalSGDOptimizer: options set on this optimizer's groups (an LR scheduler's) reach the inner
// optimizer at each step and override what was set on inner() directly; a loaded state dict's
// reach this optimizer. Groups cannot be added after construction (step() refuses).
#ifndef DTRAIN_OPTIM_DILOCO_H_
#define DTRAIN_OPTIM_DILOCO_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/optim/optimizer.h>

#include "comm/process_group.h"
#include "comm/quorum.h"
#include "optim/diloco_compression.h"
#include "optim/functional/optimizer.h"

namespace dtrain::optim {

// {"lr": 0.7, "momentum": 0.9, "nesterov": true}: the paper's outer optimizer (SGD's options).
OptionsDict default_outer_options();

// How a DiLoCo synchronises. Checked (TORCH_CHECK, naming the option and what to do) when the
// DiLoCo is constructed; conflicts are listed with each option.
struct DiLoCoOptions {
  // The ranks whose pseudo-gradients are averaged: the world for plain DiLoCo, or e.g. the ranks
  // with one local rank across nodes when DDP runs within each node. Required (dtrain has no
  // implicit world group: pass the one init_process_group returned); this rank must be a member.
  // Unset when `quorum` is (each quorum brings its own group).
  comm::Group group;
  // H: inner steps per outer round (torchft's `sync_every`; the paper's H, whose 500 is the
  // default). >= 1, and a multiple of `fragments`.
  int64_t sync_every = 500;
  // The outer optimizer: any name in FunctionalRegistry::global() (a built-in's PyTorch name,
  // "SGD", "Adam", "AdamW", ..., or one a user registered), created over the global parameters
  // with `outer_options`.
  std::string outer_optimizer = "SGD";
  // The outer optimizer's options, PyTorch's keys. Default: default_outer_options(), which are
  // SGD's: when you change `outer_optimizer`, give that optimizer's options too (the outer
  // optimizer refuses keys it does not know, e.g. Adam refuses "nesterov"). A c10 dict is shared
  // on copy; DiLoCo copies it at construction.
  OptionsDict outer_options = default_outer_options();
  // Streaming DiLoCo, as torchft's DiLoCo with `fragments` model fragments: the parameters (in
  // the inner optimizer's order, groups concatenated) are cut into this many contiguous fragments
  // of about equal element counts (fragment_params() gives them); every sync_every / fragments
  // inner steps one fragment synchronises, in turn 0, 1, ..., so fragment f syncs after inner
  // steps (f + 1) * sync_every / fragments + k * sync_every. Only that fragment's pseudo-gradient
  // is all-reduced (see fragment_sync_delay for when), stepped by the outer optimizer and copied
  // (see fragment_update_alpha) into the local parameters. >= 1 (1: plain DiLoCo), at most the
  // number of parameters, and dividing `sync_every`.
  int64_t fragments = 1;
  // Compressed outer gradients (Streaming DiLoCo's low-precision outer gradients, arXiv
  // 2501.18512; torchft's quantized all-reduce). Each rank turns its pseudo-gradient (in float32;
  // float64 ones are rounded to float32 first) into the codes below; the ranks all-gather the
  // codes; every rank decodes every rank's, sums them in rank order and divides by the group's
  // size (identical bits on every rank), and the outer optimizer steps on that average, cast to
  // the global copies' dtype. The bytes a rank sends per sync are then (n-1) x the compressed size
  // (optim/diloco_compression.h: outer_compressed_bytes), against 2(n-1)/n x 4 bytes per element
  // for "none"'s ring all-reduce: an all-gather because a sum of codes is not a code (an all-reduce
  // would decode and re-encode at every hop, each rank adding its own rounding), and it is exact
  // and simple. So it sends fewer bytes than "none" only while n x bytes per element < 8: up to
  // 3 ranks for "bfloat16", 7 for "fp8_e4m3", 14 for "4bit" (a reduce-scatter of codes, then an
  // all-gather of re-encoded averages, would scale, at the cost of a second rounding; torchft
  // re-quantises so). No error feedback:
  // what the rounding drops is lost, not carried to the next round. Values:
  //   "none" (default): float32 pseudo-gradients, one all-reduce: exactly the path without this
  //     option.
  //   "bfloat16": rounded to nearest even (Tensor::to(kBFloat16)); 2 bytes per element; relative
  //     error at most 2^-8.
  //   "fp8_e4m3": blocks of 64 consecutive elements of the fragment's flat pseudo-gradient (the
  //     parameters in order, so a block may span two; the last may be shorter), each with its
  //     float32 absmax; the element x / (absmax / 448), clamped to +-448, rounded to nearest even
  //     float8_e4m3fn; decoded as code * (absmax / 448). 1 byte per element + 4 per block; error
  //     at most max(2^-4 |x|, 2^-10 absmax / 448) (3 mantissa bits; subnormals below 2^-6).
  //   "4bit": the same blocks and absmaxes; the code round(x / (absmax / 7)) (half to even) in
  //     [-7, 7], two's complement, two per byte; decoded as code * (absmax / 7). Half a byte per
  //     element + 4 per block (9/64 of float32's bytes); error at most absmax / 14 (half a step).
  // A block of zeros stays zero. Conflicts: none. Recorded in the state dict: a resume with a
  // different value is refused (load_state_dict).
  std::string outer_compression = "none";
  // tau, Streaming DiLoCo's overlap (torchft's `fragment_sync_delay`): the inner steps a
  // fragment's all-reduce runs behind. With K = sync_every / fragments, the fragment that syncs
  // after inner step K of a round has its pseudo-gradient taken (global minus local, as then) and
  // its all-reduce (or, with outer_compression, its all-gather of codes) issued after inner step
  // K - tau, without waiting; inner steps K - tau + 1 .. K run while it is in flight; after step K
  // DiLoCo waits for it, the outer optimizer steps the fragment's global parameters on that
  // average, and the local ones are set from them (see fragment_update_alpha). So the progress of
  // those tau steps on the fragment's parameters is dropped at alpha 0, as in torchft. Default 0:
  // issued and waited after step K, the blocking sync, bit for bit what DiLoCo did before the
  // option. 0 <= tau < K: a fragment's all-reduce must be issued within the round it ends (set
  // sync_every / fragments larger to allow more). Recorded in the state dict: a resume with a
  // different value is refused.
  int64_t fragment_sync_delay = 0;
  // How a synced fragment's local parameters mix with its new global ones (torchft's
  // `fragment_update_alpha`): local = lerp(global, local, alpha) = global + alpha (local - global),
  // at::lerp in the global copy's precision (float32, float64 for float64 parameters), then
  // rounded to the parameter's dtype; `local` is the parameter after inner step K (tau steps past
  // its pseudo-gradient). Default 0: the local parameters are replaced by the global ones (a copy,
  // bit for bit what DiLoCo did before the option); 1: the local ones are kept (the outer step
  // only moves the global copy, which the next pseudo-gradient is taken against). In [0, 1].
  double fragment_update_alpha = 0.0;
  // Fault tolerance, as torchft's Manager (comm/quorum.h): when set, `group` stays unset and every
  // outer synchronisation first forms a quorum of the replicas that arrive (a replica dead or cut
  // off is dropped after the client's join_timeout), averages the pseudo-gradients of its
  // participants over the quorum's own Gloo group, and commits the round among them; a member
  // behind (a restarted replica, one that missed a commit) first receives the state dict of one
  // at the quorum's step over that group (broadcast_object: nothing read from disk), contributes
  // zeros, and leaves the round with the others' bits. A failed collective (a member died during
  // it) is not committed: the round is retried in the next quorum, up to `max_quorum_retries`
  // times. A restarted replica calls join_quorum() before its first step. Default: null (the
  // plain collective over `group`). Conflicts: `group`; fragments > 1, fragment_sync_delay > 0
  // and outer_compression other than "none" (not supported with it yet).
  std::shared_ptr<comm::QuorumClient> quorum;
  // Quorums tried for one round before step() gives up (TORCH_CHECK with the last error). >= 1.
  int64_t max_quorum_retries = 5;
};

// The options' own checks (the ranges and conflicts above, not the outer optimizer's options nor
// the group), with their messages; DiLoCo's constructor runs them. `num_params` is the number of
// parameters DiLoCo would wrap.
void check_diloco_options(const DiLoCoOptions& options, size_t num_params);

class DiLoCo : public torch::optim::Optimizer {
 public:
  // Wraps `inner` (any torch::optim optimizer: LibTorch's, a FunctionalOptimizerAdapter, ...) and
  // copies its current parameters as the global parameters: float32 for float32, bfloat16 and
  // float16 parameters, float64 for float64 ones. Not a collective. TORCH_CHECK: a null inner
  // optimizer, one without parameters, a parameter that is not floating point, the options'
  // checks (check_diloco_options), this rank outside `group`, and the outer optimizer's creation
  // (an unknown name, options it refuses), each naming what was wrong and what to do.
  DiLoCo(std::unique_ptr<torch::optim::Optimizer> inner, DiLoCoOptions options);

  // The inner step (with `closure`, returning its loss); then, at the end of a round, the outer
  // step of this round's fragment. A collective over the group once a round (every
  // sync_every / fragments inner steps), issued after inner step K - fragment_sync_delay of the
  // round and waited after step K (the same step when the delay is 0): one all-reduce of the
  // fragment's pseudo-gradients in one flat buffer (each divided by the group's size first, as
  // average_parameters does), or with outer_compression one all-gather of their codes (see
  // there), then the outer optimizer's step on the global parameters, which are then copied (or,
  // with fragment_update_alpha, lerped) into the local ones. The inner optimizer's state is kept
  // across rounds, as torchft keeps it.
  at::Tensor step(LossClosure closure = nullptr) override;

  // The inner optimizer's state dict in PyTorch's format (optimizer_state_dict), plus the entry
  // "diloco": {"local_step": inner steps since the last sync, "outer_step": syncs so far,
  // "sync_every", "fragments", "outer_compression", "fragment_sync_delay", "global_params": [tensor
  // per parameter], "outer_optimizer": the outer optimizer's state dict}, and while a fragment's
  // all-reduce is in flight (fragment_sync_delay > 0, from inner step K - delay of a round until
  // step K) "pending_average": its result, the fragment's averaged pseudo-gradient (1-D, the
  // fragment's parameters in order). To take it, state_dict waits for that all-reduce: every rank
  // issued it already, so this is no new collective and needs nothing from the other ranks but
  // that they go on stepping; the run then continues as it would have (the result is the same
  // bits). Tensors are the live ones, as every state dict here: save or copy it before stepping
  // again. With a ZeroRedundancyOptimizer inside (ZeRO within a replica, DiLoCo across replicas),
  // the inner part is ZeRO's global state dict: call inner()'s consolidate_state_dict(to) first
  // (a collective over ZeRO's group) and take state_dict() on rank `to` of that group (elsewhere
  // ZeRO's error); load_state_dict on every rank of the replica loads that rank's part. (Not with
  // DiLoCoOptions::quorum: the constructor refuses a ZeRO inside then.)
  c10::IValue state_dict();
  // Loads such a dict. Everything of the "diloco" entry is checked before anything changes: the
  // entry present, the counters whole numbers in range, sync_every, fragments,
  // outer_compression and fragment_sync_delay equal to this DiLoCo's (a dict without
  // "outer_compression" or "fragment_sync_delay", written before the option, counts as "none" or
  // 0), one global parameter per parameter, each a tensor of its parameter's shape, of the global
  // copy's dtype (float32, or float64 for float64 parameters) and finite, "pending_average"
  // present exactly when local_step and fragment_sync_delay say an all-reduce was in flight, then
  // 1-D with the fragment's element count, of its average's dtype and finite, and the outer
  // optimizer's state (FunctionalOptimizer::check_state_dict); then the inner optimizer's state is
  // loaded (its own checks), then the DiLoCo part. A loaded pending average is used at its
  // fragment's sync step with no collective (every rank resumes from the same step, so none
  // issues one); an all-reduce this DiLoCo itself had in flight is dropped, not waited. Not a
  // collective. Errors (c10::Error): one line naming the key, the parameter's index and what was
  // expected. A run resumed this way (with the local parameters it had) continues bit for bit as
  // if it had not stopped, also through a dict taken while an all-reduce was in flight.
  void load_state_dict(const c10::IValue& state_dict);

  // With DiLoCoOptions::quorum: waits for the next quorum of the running job (a collective with
  // the other replicas' next sync) without an update of its own, fetches the state of a healthy
  // replica there if this one is behind, and leaves this optimizer and its parameters at the
  // quorum's committed round, as the others leave that sync. Call it once on a replica started to
  // replace a lost one (or on every replica at the job's start: the first quorum then only checks
  // that all are at step 0), before its first step. TORCH_CHECK: no quorum option, inner steps
  // taken since the last sync, or no quorum within the client's quorum_timeout (its message).
  void join_quorum();
  // With DiLoCoOptions::quorum: the quorum of the last synchronisation (nullptr before the
  // first): its members, steps and participants.
  const comm::Quorum* last_quorum() const {
    return last_quorum_.has_value() ? &*last_quorum_ : nullptr;
  }

  torch::optim::Optimizer& inner() { return *inner_; }
  FunctionalOptimizer& outer() { return *outer_; }
  // The global parameters (what the last round agreed on), one per parameter.
  const std::vector<at::Tensor>& global_params() const { return global_; }
  // Indices (into the parameters, groups concatenated) of fragment f's parameters.
  const std::vector<int64_t>& fragment_params(size_t f) const { return fragments_.at(f); }
  int64_t local_step() const { return local_step_; }
  int64_t outer_step() const { return outer_step_; }
  const DiLoCoOptions& options() const { return options_; }

 private:
  std::vector<at::Tensor> local_params() const;
  void sync_options(bool to_inner);
  std::vector<at::Tensor> checked_local_params() const;
  void prepare_sync(const std::vector<int64_t>& fragment);
  at::Tensor wait_pending();
  void perform_sync(const std::vector<int64_t>& fragment);
  void quorum_sync(bool has_update);                                   // diloco_quorum.cc
  absl::Status quorum_round(const comm::Quorum& q, bool& has_update);  // diloco_quorum.cc
  absl::Status quorum_exchange(const comm::Quorum& q, bool& has_update,
                               at::Tensor& average);  // diloco_quorum.cc

  std::unique_ptr<torch::optim::Optimizer> inner_;
  DiLoCoOptions options_;
  std::vector<at::Tensor> global_;
  std::unique_ptr<FunctionalOptimizer> outer_;
  std::vector<std::vector<int64_t>> fragments_;
  int64_t local_step_ = 0;
  int64_t outer_step_ = 0;
  // The fragment's average issued by prepare_sync and not yet used by perform_sync: in flight
  // (`work` or `compressed`) or, once waited (state_dict, a loaded state dict), `average`.
  struct Pending {
    c10::intrusive_ptr<c10d::Work> work;  // "none": the all-reduce of `average`, until waited
    std::optional<PendingCompressedAverage> compressed;  // outer_compression: its all-gather
    at::Tensor average;  // "none": the buffer being reduced; then the average
  };
  std::optional<Pending> pending_;
  std::optional<comm::Quorum> last_quorum_;
};

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_DILOCO_H_
