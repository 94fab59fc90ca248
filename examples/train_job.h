// examples:train's parts, one function per concern, in the order train() calls them: join the
// job, check the checkpoint directory on every rank, make the models and their DDP, the optimizer,
// the hook, resume, then (train.cc) run the steps, saving a step now and then, and summarise.
//
//   const Job job = join_job(config);
//   Trainer t;
//   make_models(config, job, t);
//   make_optimizer(config, job, t);
//   register_hook(config, job, t);
//   const int start = resume(config, job, ckpts, t, progress);   // 0 unless --resume / a restart
//   ... save_step(config, job, ckpts, t, step);
//
// Every function ends the process with a one-line error (die: "train: ...", exit 2 for usage, 1
// at run time) rather than returning one: this is a program's top level.
#ifndef DTRAIN_EXAMPLES_TRAIN_JOB_H_
#define DTRAIN_EXAMPLES_TRAIN_JOB_H_

#include <cstdint>
#include <memory>
#include <string>

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include "absl/strings/string_view.h"
#include "checkpoint/step_checkpoints.h"
#include "comm/process_group.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "ddp_hooks/powersgd_hook.h"
#include "examples/train_config.h"
#include "examples/train_progress.h"
#include "optim/functional/adapter.h"
#include "optim/functional/torch_state.h"
#include "optim/post_local_sgd_optimizer.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::examples {

using Config = TrainConfig;

inline constexpr int64_t kIn = 32, kOut = 8;  // the task's input and output widths
inline constexpr char kShardedNeedsZero[] =
    "--resume: this checkpoint's optimizer state is sharded (written with --sharded_checkpoint); "
    "resume with --zero";

// One-line errors for the user: "train: ..." and an exit code (2: usage, 1: runtime).
[[noreturn]] void die(int code, const std::string& message);
// die() for a rank stopped by another's failure, after a moment for that rank's line (the cause).
[[noreturn]] void die_after_peer(int code, const std::string& message);
// "checkpoint: <message>", once: checkpoint/'s own messages already start with "checkpoint".
std::string checkpoint_error(absl::string_view message);
// What the heartbeats say about a failure, for its message: "; rank 1 stopped responding (...)",
// "; every rank is alive (heartbeats continue)" (a hang, not a lost rank) or why it cannot tell,
// when the failure is a collective's or its transport's (a c10d DistError, a timeout, Gloo's or
// NCCL's errors, a closed connection, an object collective); else "" -- a bad file or an
// allocation has nothing to do with the heartbeats. Asking takes up to three heartbeat periods.
std::string heartbeat_cause(const std::exception& e);
std::string heartbeat_cause(const absl::Status& s);
// The CPU generator of the weights and of each step's batch.
torch::Generator generator(uint64_t seed);

// The optimizer behind one of three shapes: ZeRO, plain Adam, or post-local SGD around Adam.
struct Optimizer {
  std::unique_ptr<optim::ZeroRedundancyOptimizer> zero;
  std::unique_ptr<optim::FunctionalOptimizerAdapter> adam;
  std::unique_ptr<optim::PostLocalSGDOptimizer> post_local;

  torch::optim::Optimizer& get() {
    if (zero) return *zero;
    if (post_local) return *post_local;
    return *adam;
  }
  int64_t local_state_bytes() {
    if (zero) return zero->local_state_bytes();
    if (post_local) return optim::state_tensor_bytes(post_local->state_dict());
    return optim::state_tensor_bytes(adam->state_dict());
  }
  // Collective with ZeRO: the global state, valid on rank 0.
  c10::IValue global_state_dict() {
    if (zero) {
      zero->consolidate_state_dict(0);
      return zero->rank() == 0 ? zero->state_dict() : c10::IValue();
    }
    if (post_local) return post_local->state_dict();
    return adam->state_dict();
  }
  void load_state_dict(const c10::IValue& sd) {
    if (zero) return zero->load_state_dict(sd);
    if (post_local) return post_local->load_state_dict(sd);
    adam->load_state_dict(sd);
  }
};

// Where this rank runs: its group, device and the launch it belongs to.
struct Job {
  comm::Group world;
  int rank = 0, world_size = 1;
  c10::Device device{c10::kCPU};
  torch::TensorOptions on_group;  // the small tensors of train()'s own collectives (NCCL: its GPU)
  std::string run_id;             // TORCHELASTIC_RUN_ID, written into every checkpoint
  int restart_count = 0;          // TORCHELASTIC_RESTART_COUNT: which attempt of the launch this is
};

// The model being trained, its DDP and what steps it.
struct Trainer {
  torch::nn::Sequential teacher{nullptr}, model{nullptr};
  std::unique_ptr<ddp_hooks::DistributedDataParallel> ddp;
  Optimizer opt;
  std::shared_ptr<ddp_hooks::PowerSGDState> powersgd;        // --hook=powersgd
  std::shared_ptr<ddp_hooks::PostLocalSGDState> post_local;  // --hook=post_local_sgd
  int64_t local_sgd_start = 0;  // post-local SGD's switch to local steps follows --steps
};

Job join_job(const Config& c);
Progress make_progress(const Config& c, const Job& job);
void check_checkpoint_dir_everywhere(const Config& c, const Job& job);
void make_models(const Config& c, const Job& job, Trainer& t);
void make_optimizer(const Config& c, const Job& job, Trainer& t);
void register_hook(const Config& c, const Job& job, Trainer& t);
// --resume (or a restart of this job): the newest committed step -- model, optimizer (global or
// sharded) and hook state all from its step directory, read onto this rank's device. Returns the
// step to continue after (0 when not resuming).
int resume(const Config& c, const Job& job, checkpoint::StepCheckpoints& ckpts, Trainer& t,
           Progress& progress);
// One step directory, committed by rank 0 only after every rank wrote its part: a crash anywhere
// before the commit leaves the previous step current and complete. Collective.
void save_step(const Config& c, const Job& job, checkpoint::StepCheckpoints& ckpts, Trainer& t,
               int step);

}  // namespace dtrain::examples

#endif  // DTRAIN_EXAMPLES_TRAIN_JOB_H_
