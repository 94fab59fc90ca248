#include <filesystem>
#include <string>

#include <torch/torch.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/state_file.h"
#include "comm/agreement.h"
#include "examples/train_checkpoint.h"
#include "examples/train_job.h"

namespace dtrain::examples {
namespace {

// A restarted attempt (--max_restarts, or torchrun's) continues from the newest step this job
// committed; a step left in the directory by an earlier job is not this job's state, so without
// one the attempt starts afresh.
bool resumes_on_restart(const Config& c, const Job& job, checkpoint::StepCheckpoints& ckpts,
                        Progress& progress) {
  if (job.restart_count == 0 || c.resume || c.checkpoint_dir.empty() ||
      absl::IsNotFound(ckpts.latest().status())) {
    return false;
  }
  absl::StatusOr<examples::TrainCheckpoint> last = examples::read_train_checkpoint(ckpts);
  const bool mine =
      !last.ok() || job.run_id.empty() || last->run_id == job.run_id;  // no run id: cannot tell
  if (!mine) {
    progress.note(absl::StrCat("restart ", job.restart_count,
                               ": no step of this job was committed in ", c.checkpoint_dir,
                               " (its newest is another job's); starting from step 0"));
  }
  return mine;
}

// The optimizer state of a checkpoint: the global state dict, or (sharded) the pieces of the
// shards this rank owns now.
void load_optimizer(const examples::TrainCheckpoint& ck, Trainer& t) {
  if (!ck.sharded) return t.opt.load_state_dict(ck.optimizer);
  if (!t.opt.zero) die(2, kShardedNeedsZero);
  absl::StatusOr<c10::IValue> saved_step =
      t.opt.zero->load_sharded((std::filesystem::path(ck.dir) / kShardDir).string());
  if (!saved_step.ok()) die(2, absl::StrCat("--resume: ", saved_step.status().message()));
  if (!saved_step->isInt() || saved_step->toInt() != ck.step) {
    die(2,
        absl::StrCat("--resume: the optimizer shards in ", ck.dir, " are not from step ", ck.step));
  }
}

// The hook's per-rank state, when it was saved at this world size with this hook.
void load_hook_state(const Config& c, const Job& job, const examples::TrainCheckpoint& ck,
                     Trainer& t) {
  const int start = static_cast<int>(ck.step);
  if (t.post_local) t.post_local->iter = start;
  if (!t.powersgd) return;
  if (ck.world_size != job.world_size || ck.hook != c.hook) {
    t.powersgd->iter = start;
    return;
  }
  const std::string file = examples::hook_file(ck.dir, job.rank);
  absl::StatusOr<c10::IValue> hs =
      checkpoint::load_state(file);  // the hook moves it to the buckets' device
  if (!hs.ok()) die(2, absl::StrCat("--resume: ", hs.status().message()));
  // The hook counts one iteration per backward and train() runs one backward per step (from
  // step 0, or from a resumed step with `iter` set to it), so a state saved at step N has iter N.
  if (absl::Status s = t.powersgd->load_state_dict(*hs, ck.step); !s.ok()) {
    die(2, absl::StrCat(
               "--resume: ", file, ": ", s.message(),
               absl::StrContains(s.message(), "'start_powerSGD_iter'")
                   ? absl::StrCat("; it is --powersgd_start_iter (", c.powersgd_start_iter,
                                  " in this run): pass the value the checkpoint was written with")
                   : ""));
  }
}

}  // namespace

int resume(const Config& c, const Job& job, checkpoint::StepCheckpoints& ckpts, Trainer& t,
           Progress& progress) {
  if (!c.resume && !resumes_on_restart(c, job, ckpts, progress)) return 0;
  absl::StatusOr<examples::TrainCheckpoint> ck = examples::read_train_checkpoint(ckpts, job.device);
  if (!ck.ok()) {
    die(2, absl::StrCat("--resume: ", ck.status().message(),
                        absl::IsNotFound(ck.status())
                            ? "; run once without --resume to create a checkpoint"
                            : ""));
  }
  if (absl::Status s = examples::load_weights(ck->model, *t.model); !s.ok())
    die(2, absl::StrCat("--resume: ", s.message()));
  load_optimizer(*ck, t);
  load_hook_state(c, job, *ck, t);
  progress.note(absl::StrCat(
      "resumed from step ", ck->step, " (", ck->file, ", written by ", ck->world_size, " ranks)",
      job.restart_count > 0 ? absl::StrCat(" on restart ", job.restart_count) : ""));
  return static_cast<int>(ck->step);
}

namespace {

// Every rank agrees that every rank succeeded (a failure anywhere stops everyone, naming it).
void agree(const Job& job, const absl::Status& mine, const char* what) {
  const absl::Status all = comm::first_failure(job.world, mine);
  if (!mine.ok()) die(1, checkpoint_error(mine.message()));
  if (!all.ok())
    die_after_peer(1, absl::StrCat("checkpoint: ", all.message(), " to ", what, "; see its error"));
}

// The checkpoint file's dict: the step, who wrote it, the weights and the (global) optimizer state.
c10::impl::GenericDict checkpoint_dict(const Config& c, const Job& job, Trainer& t, int step,
                                       const c10::IValue& optimizer_state) {
  c10::impl::GenericDict weights(c10::StringType::get(), c10::AnyType::get());
  for (const auto& item : t.model->named_parameters())
    weights.insert(item.key(), item.value().detach().clone());
  c10::impl::GenericDict ckpt(c10::StringType::get(), c10::AnyType::get());
  ckpt.insert("step", static_cast<int64_t>(step));
  ckpt.insert("world_size", static_cast<int64_t>(job.world_size));
  ckpt.insert("model", weights);
  if (c.sharded_checkpoint) {
    ckpt.insert("optimizer_shards", std::string(kShardDir));
  } else {
    ckpt.insert("optimizer", optimizer_state);
  }
  ckpt.insert("hook", c.hook);
  ckpt.insert("zero", c.zero);
  if (!job.run_id.empty()) ckpt.insert("run_id", job.run_id);
  return ckpt;
}

}  // namespace

void save_step(const Config& c, const Job& job, checkpoint::StepCheckpoints& ckpts, Trainer& t,
               int step) {
  absl::StatusOr<std::string> step_dir = std::string();
  if (job.rank == 0) step_dir = ckpts.begin(step);
  if (job.rank == 0 && step_dir.ok() && c.sharded_checkpoint) {
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(*step_dir) / kShardDir, ec);
    if (ec)
      step_dir = absl::UnavailableError(
          absl::StrCat("cannot create ", *step_dir, "/", kShardDir, ": ", ec.message()));
  }
  agree(job, step_dir.status(), "create the step directory");
  step_dir = ckpts.dir_of(step);
  c10::IValue optimizer_state;
  if (c.sharded_checkpoint) {
    absl::Status s =
        t.opt.zero->save_sharded((std::filesystem::path(*step_dir) / kShardDir).string(),
                                 c10::IValue(static_cast<int64_t>(step)));
    if (!s.ok()) die(1, checkpoint_error(s.message()));
  } else {
    optimizer_state = t.opt.global_state_dict();
  }
  absl::Status hook_saved;
  if (t.powersgd)
    hook_saved =
        checkpoint::save_state(examples::hook_file(*step_dir, job.rank), t.powersgd->state_dict());
  agree(job, hook_saved, "write its hook state");
  if (job.rank != 0) return;
  absl::Status s =
      checkpoint::save_state((std::filesystem::path(*step_dir) / kCheckpointFile).string(),
                             checkpoint_dict(c, job, t, step, optimizer_state));
  if (s.ok()) s = ckpts.commit(step);
  if (!s.ok()) die(1, checkpoint_error(s.message()));
}

}  // namespace dtrain::examples
