// PowerSGD gradient compression (Vogels et al.), as PyTorch's powerSGD_hook and
// batched_powerSGD-style batching: each compressible gradient matrix M (n x m) is sent as
// P = M Q (n x r) and Q = M^T P (m x r) -- two all-reduces of (n + m) r numbers instead of n m --
// with error feedback and warm start. 1-D tensors and matrices not worth compressing
// (min_compression_rate) are all-reduced uncompressed in one batch. The first
// start_powerSGD_iter iterations run plain all-reduce.
//
//   auto state = std::make_shared<dtrain::ddp_hooks::PowerSGDState>(group);
//   state->matrix_approximation_rank = 2;
//   state->start_powerSGD_iter = 10;
//   ddp.register_comm_hook(std::make_unique<dtrain::ddp_hooks::PowerSGDHook>(state));
//   c10::IValue saved = state->state_dict();   // CPU tensors, for checkpoint::save_state
//   ...   // later, a state constructed with the same settings (PyTorch #75666), on every rank:
//   PowerSGDExpected expected{.iter = step, .buckets = powersgd_buckets(ddp), .file = file};
//   absl::StatusOr<c10::IValue> sd = checkpoint::load_state(file);
//   absl::Status s = sd.ok() ? state->load_state_dict(*sd, expected) : sd.status();  // no collective
//   s = comm::first_failure(group, s);   // the ranks agree before the first step's collectives
//
// The hook does its work when DDP hands it a bucket (the all-reduces run to completion there),
// so it overlaps less with backward than the plain all-reduce does. Buckets may be on any device:
// the random matrices are drawn on the CPU (the same on every rank and device, as PyTorch draws
// them) and copied to the bucket's device, where the error-feedback and P/Q memories live.
#ifndef DTRAIN_DDP_HOOKS_POWERSGD_HOOK_H_
#define DTRAIN_DDP_HOOKS_POWERSGD_HOOK_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/comm.hpp>

#include "absl/status/status.h"
#include "comm/process_group.h"
#include "ddp_hooks/bucket_hook.h"

namespace dtrain::ddp_hooks {

class DistributedDataParallel;

// One DDP bucket as the PowerSGD hook sees it: what a loaded state's memories must fit.
struct PowerSGDBucket {
  std::vector<std::vector<int64_t>> shapes;  // its gradients' (the parameters'), in bucket order
  at::ScalarType dtype = at::kFloat;         // the bucket's: the error, P and Q memories'
};

// The buckets of `ddp`, by index, as its hook gets them: in the parameters' dtype, or in
// `hook_dtype` when the hook runs inside a CompressWrapper (fp16/bf16_compress_wrapper). Not a
// collective.
std::vector<PowerSGDBucket> powersgd_buckets(const DistributedDataParallel& ddp,
                                             std::optional<at::ScalarType> hook_dtype = {});

// What a state to resume must fit besides the running state's settings, rank and world size.
struct PowerSGDExpected {
  // The iteration it was written at: examples:train's checkpoint step (the hook counts one
  // iteration per backward, no_sync passes not included). Unset: any in [0, 10^12].
  std::optional<int64_t> iter;
  // The model's buckets (powersgd_buckets). Unset: the memories' lengths and dtypes, and that
  // every bucket has them, are checked by the hook at each bucket's first use instead (a c10::Error
  // on that rank only, while the others may already be inside a collective: pass them).
  std::optional<std::vector<PowerSGDBucket>> buckets;
  // The file the state was read from, named by every message ("PowerSGD state file F: ...").
  std::string file;
};

struct PowerSGDState {
  explicit PowerSGDState(comm::Group group) : group(std::move(group)) {}

  // PyTorch's PowerSGDState fields, same meanings and defaults.
  comm::Group group;
  int64_t matrix_approximation_rank = 1;
  int64_t start_powerSGD_iter = 1000;  // plain all-reduce before this iteration
  double min_compression_rate = 2;     // compress only when (n + m) r * rate < n m
  bool use_error_feedback = true;
  bool warm_start = true;
  double orthogonalization_epsilon = 0;
  uint64_t random_seed = 0;
  bool batch_tensors_with_same_shape = false;

  // Run-time state. The tensors are 1-D, on the bucket's device and in its dtype (until their
  // first use after load_state_dict: on the CPU, see there).
  int64_t iter = 0;
  std::map<int64_t, at::Tensor> error_dict;     // per bucket: local compression error
  std::map<int64_t, at::Tensor> p_memory_dict;  // per bucket: all Ps, flat
  std::map<int64_t, at::Tensor> q_memory_dict;  // per bucket: all Qs, flat (warm start)
  int64_t total_numel_before_compression = 0;
  int64_t total_numel_after_compression = 0;
  // Buckets whose error_dict / p_memory_dict and q_memory_dict entries load_state_dict brought in
  // and the hook has not checked against the bucket yet (it does at their first use).
  std::set<int64_t> unchecked_error_buckets;
  std::set<int64_t> unchecked_memory_buckets;
  // Set by load_state_dict when the loaded state had compressed (iter > start_powerSGD_iter): during
  // the next iteration every bucket must find its memories there, and none may be for a bucket the
  // model does not have (the hook checks at each bucket's first use; a misfit is a c10::Error).
  bool check_loaded_buckets = false;

  // TORCH_CHECK with PyTorch's message: start_powerSGD_iter must be > 1 with error feedback or
  // warm start; rank >= 1; rate >= 1.
  void validate() const;
  // compression_rate = numel before / numel after, over everything sent so far.
  double compression_rate() const;

  // Everything needed to resume (hyper-parameters, iter, error / P / Q memories, RNG, and the
  // group's rank and world size: a per-rank state), with every tensor a CPU copy (what
  // checkpoint::save_state writes), whatever the buckets' device. PyTorch's __getstate__ keys
  // where PyTorch has the field; docs/checkpoints.md lists dtrain's others.
  c10::IValue state_dict() const;

  // Checks a state_dict() read back from a file (untrusted) completely, changing nothing and
  // without any collective, so that every rank can check its own file and the ranks agree on the
  // verdict before the first collective. OK when load_state_dict would accept it:
  //  - a dict of exactly the keys state_dict() writes, each of its type and range;
  //  - the settings (matrix_approximation_rank, start_powerSGD_iter, min_compression_rate,
  //    use_error_feedback, warm_start, orthogonalization_epsilon, random_seed,
  //    batch_tensors_with_same_shape) equal to this state's: a state is resumed, not reconfigured;
  //  - 'rank' and 'world_size' equal to this state's group's (a file without them, written before
  //    dtrain recorded them, is refused: another rank's file could not be told from it);
  //  - 'iter' equal to expected.iter; no memory and no count up to start_powerSGD_iter (the hook
  //    keeps and counts nothing before it compresses);
  //  - every memory a 1-D tensor of finite numbers (no NaN or inf), and with expected.buckets:
  //    only for buckets the model has, of its bucket's dtype and length (error: the bucket's
  //    length; P and Q: internal/powersgd_plan.h's), and, once the state has compressed (iter >
  //    start_powerSGD_iter), for every bucket (error_dict with use_error_feedback, P and Q with
  //    warm_start); with orthogonalization_epsilon 0, no Q whose orthogonalisation at the next
  //    step divides by zero (a column of zeros: PyTorch's hook would train NaN from there).
  //    All-zero error memories are PyTorch's own state after an error-feedback reset, and zero Q
  //    columns with orthogonalization_epsilon > 0 its state after a vanishing gradient: accepted.
  // Errors: DataLoss (the file's content is not such a state) and InvalidArgument (a setting,
  // rank, world size or iter that differs from this run's), one line naming expected.file, the
  // key, the bucket where there is one, what was found and what was expected.
  absl::Status check_state_dict(const c10::IValue& state_dict,
                                const PowerSGDExpected& expected) const;

  // check_state_dict, then resumes from it (a refused load leaves this state as it was). The
  // memories are kept as CPU tensors; the hook moves each to its bucket's device at its first use
  // (without expected.buckets it checks it there first: a c10::Error before any collective on
  // this rank). Not while a backward runs the hook.
  absl::Status load_state_dict(const c10::IValue& state_dict, const PowerSGDExpected& expected);
  // load_state_dict(state_dict, {.iter = expected_iter}): the buckets checked at first use.
  absl::Status load_state_dict(const c10::IValue& state_dict, std::optional<int64_t> expected_iter);
  // The same, throwing c10::Error with that message (the torch-style form).
  void load_state_dict(const c10::IValue& state_dict);

  std::mt19937_64 rng{0};
  bool rng_seeded = false;
};

namespace internal {
class OrderedWorker;
}  // namespace internal

// runHook returns at once: the bucket's compression, its all-reduces and the decompression run on
// the group's hook thread (ddp_hooks/internal/ordered_worker.h: one bucket after another, so every
// rank issues the collectives in the same order) while backward goes on, as PyTorch's chain of
// Future::then. The future completes with the decompressed bucket, or holds the error (a state
// that does not fit the bucket: a c10::Error, the bucket unchanged). Wait for it before reading
// the bucket or the state.
class PowerSGDHook : public StatefulHook<PowerSGDState> {
 public:
  explicit PowerSGDHook(std::shared_ptr<PowerSGDState> state);
  ~PowerSGDHook() override;
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;

 private:
  c10::intrusive_ptr<c10::ivalue::Future> run(c10d::GradBucket& bucket);  // on the worker
  std::shared_ptr<internal::OrderedWorker> worker_;
  c10::intrusive_ptr<c10::ivalue::Future> last_;  // waited for by the destructor
};

// Orthonormalises the columns of each matrix in a batch (b x n x r), in place: Gram-Schmidt
// (PyTorch's for rank <= 2) with `epsilon` guarding zero columns.
void orthogonalize(at::Tensor& matrices, double epsilon);

}  // namespace dtrain::ddp_hooks

#endif  // DTRAIN_DDP_HOOKS_POWERSGD_HOOK_H_
