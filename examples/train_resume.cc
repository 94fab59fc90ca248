#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/state_file.h"
#include "comm/agreement.h"
#include "examples/train_checkpoint.h"
#include "examples/train_dcp.h"
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

// One step of resuming as a Status: the loader's own, or what it threw (a torch-style
// load_state_dict's c10::Error, std::bad_alloc for state too large for this host, anything else),
// so that every failure reaches the ranks' verdict instead of ending this rank alone.
absl::Status guarded(const std::function<absl::Status()>& step) {
  try {
    return step();
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    what = what.substr(0, what.find("\nException raised from"));
    return absl::InvalidArgumentError(what);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory while loading it on this host");
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(e.what());
  }
}

// `s` with "<where>: " in front of its message (same code), or OK.
absl::Status in(const std::string& where, const absl::Status& s) {
  return s.ok() ? s : absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
}

// The global optimizer state of checkpoint.pt. Under ZeRO each rank loads only its shard's
// parameters, whose checks would name their index in the shard; the whole state is checked first
// as the unsharded Adam checks it, so that a problem names the parameter's index in the file (and
// is found on every rank alike, not only on the rank that owns the parameter).
absl::Status load_global_optimizer(const Config& c, const examples::TrainCheckpoint& ck,
                                   Trainer& t) {
  const std::string where = absl::StrCat(ck.file, ": 'optimizer'");
  return in(where, guarded([&] {
              if (t.opt.zero) {
                optim::OptionsDict adam = optim::new_options_dict();
                adam.insert("lr", c.lr);
                optim::FunctionalOptimizerAdapter unsharded(t.model->parameters(), "Adam", adam);
                unsharded.load_state_dict(ck.optimizer);
              }
              t.opt.load_state_dict(ck.optimizer);
              return absl::OkStatus();
            }));
}

// The optimizer state of a checkpoint: the global state dict, or (sharded) the pieces of the
// shards this rank owns now.
absl::Status load_optimizer(const Config& c, const examples::TrainCheckpoint& ck, Trainer& t) {
  if (ck.dcp) {
    const std::string dir = (std::filesystem::path(ck.dir) / kDcpDir).string();
    absl::StatusOr<int64_t> step;
    absl::Status loaded = guarded([&] {
      step = load_train_dcp(t, dir, /*with_model=*/false);
      return step.status();
    });
    if (!loaded.ok()) return loaded;
    if (*step != ck.step) {
      return absl::DataLossError(
          absl::StrCat("the DCP checkpoint in ", dir, " is not from step ", ck.step));
    }
    return absl::OkStatus();
  }
  if (!ck.sharded) return load_global_optimizer(c, ck, t);
  if (!t.opt.zero) return absl::FailedPreconditionError(kShardedNeedsZero);
  const std::string dir = (std::filesystem::path(ck.dir) / kShardDir).string();
  absl::StatusOr<c10::IValue> saved_step;
  absl::Status loaded = guarded([&] {
    saved_step = t.opt.zero->load_sharded(dir);
    return saved_step.status();
  });
  if (!loaded.ok()) return loaded;
  if (!saved_step->isInt() || saved_step->toInt() != ck.step) {
    return absl::DataLossError(
        absl::StrCat("the optimizer shards in ", ck.dir, " are not from step ", ck.step));
  }
  return absl::OkStatus();
}

// The hook's per-rank state, when it was saved at this world size with this hook.
absl::Status load_hook_state(const Config& c, const Job& job, const examples::TrainCheckpoint& ck,
                             Trainer& t) {
  const int start = static_cast<int>(ck.step);
  if (t.post_local) t.post_local->iter = start;
  if (!t.powersgd) return absl::OkStatus();
  if (ck.world_size != job.world_size || ck.hook != c.hook) {
    t.powersgd->iter = start;
    return absl::OkStatus();
  }
  const std::string file = examples::hook_file(ck.dir, job.rank);
  return guarded([&]() -> absl::Status {
    absl::StatusOr<c10::IValue> hs =
        checkpoint::load_state(file);  // the hook moves it to the buckets' device
    if (!hs.ok()) return hs.status();
    // The hook counts one iteration per backward and train() runs one backward per step (from
    // step 0, or from a resumed step with `iter` set to it), so a state saved at step N has iter N.
    // With the model's buckets every memory is checked here, not at the hook's first use (when
    // the other ranks may be inside a collective already).
    ddp_hooks::PowerSGDExpected expected{
        .iter = ck.step, .buckets = ddp_hooks::powersgd_buckets(*t.ddp), .file = file};
    absl::Status s = t.powersgd->load_state_dict(*hs, expected);
    if (s.ok()) return s;
    return absl::Status(
        s.code(),
        absl::StrCat(absl::StrContains(s.message(), file) ? "" : absl::StrCat(file, ": "),
                     s.message(),
                     absl::StrContains(s.message(), "'start_powerSGD_iter'")
                         ? absl::StrCat("; it is --powersgd_start_iter (", c.powersgd_start_iter,
                                        " in this run): pass the value the checkpoint was "
                                        "written with")
                         : ""));
  });
}

// Everything this rank resumes from the step, each part checked as it is loaded; no collective.
absl::Status load_step(const Config& c, const Job& job, const examples::TrainCheckpoint& ck,
                       Trainer& t) {
  if (absl::Status s = examples::load_weights(ck.model, *t.model); !s.ok()) return in(ck.file, s);
  if (absl::Status s = load_optimizer(c, ck, t); !s.ok()) return s;
  return load_hook_state(c, job, ck, t);
}

// The lowest rank whose `mine` failed, or the world size when none did. Collective.
int lowest_failed_rank(const Job& job, const absl::Status& mine) {
  std::vector<at::Tensor> lowest = {
      torch::full({1}, mine.ok() ? job.world_size : job.rank, job.on_group.dtype(torch::kInt))};
  c10d::AllreduceOptions min;
  min.reduceOp = c10d::ReduceOp::MIN;
  job.world->allreduce(lowest, min)->wait();
  return lowest[0].item<int>();
}

// Collective: the ranks' verdict on what each loaded. When any rank failed, the lowest such rank's
// message reaches every rank, which prints it and exits 2 once all have printed: every rank stops
// with the same line, none is left waiting in a collective, none aborts.
void agree_on_resume(const Job& job, const absl::Status& mine, const char* flag = "--resume") {
  int failed = job.world_size;
  absl::Status verdict;
  try {
    failed = lowest_failed_rank(job, mine);
    if (failed < job.world_size) verdict = comm::share_verdict(job.world, mine, failed);
  } catch (const std::exception& e) {
    die(1,
        absl::StrCat("rank ", job.rank, ": agreeing whether every rank resumed failed: ", e.what(),
                     mine.ok() ? "" : absl::StrCat(" (this rank: ", mine.message(), ")"),
                     heartbeat_cause(e)));
  }
  if (failed == job.world_size) return;
  if (verdict.ok()) verdict = absl::UnknownError("(the message did not arrive)");
  // One write(2): a line up to PIPE_BUF is not interleaved with rank 1's relayed copy of it.
  const std::string line =
      absl::StrCat("train: rank ", failed, ": ", flag, ": ", verdict.message(), "\n");
  std::fflush(stderr);
  if (::write(STDERR_FILENO, line.data(), line.size()) < 0) std::perror("train: write");
  try {
    job.world->barrier()->wait();    // every rank has printed before any exits (the launcher
  } catch (const std::exception&) {  // stops the others at the first exit)
  }
  std::exit(2);
}

}  // namespace

int resume(const Config& c, const Job& job, checkpoint::StepCheckpoints& ckpts, Trainer& t,
           Progress& progress) {
  const bool resuming = c.resume || resumes_on_restart(c, job, ckpts, progress);
  if (!resuming && !c.init_from_dcp.empty()) {
    // Every rank reads its part (the model, its optimizer pieces), then the ranks agree.
    absl::StatusOr<int64_t> step;
    const absl::Status loaded = guarded([&] {
      step = load_train_dcp(t, c.init_from_dcp, /*with_model=*/true);
      return step.status();
    });
    agree_on_resume(job, loaded, "--init_from_dcp");
    if (*step >= c.steps) {
      die(2, absl::StrCat("--init_from_dcp=", c.init_from_dcp, " is at step ", *step,
                          ", at or past --steps=", c.steps, ": nothing to train"));
    }
    // The hooks count steps from there (a DCP checkpoint holds no per-rank hook state: PowerSGD
    // starts its memories afresh, as after a resume at another world size).
    if (t.post_local) t.post_local->iter = static_cast<int>(*step);
    if (t.powersgd) t.powersgd->iter = *step;
    progress.note(
        absl::StrCat("started from step ", *step, " of DCP checkpoint ", c.init_from_dcp));
    return static_cast<int>(*step);
  }
  if (!resuming) return 0;
  // Every rank reads and checks its part of the step (checkpoint.pt, its optimizer shards, its
  // hook file) before any collective, then the ranks agree: one rank's bad file stops them all.
  absl::StatusOr<examples::TrainCheckpoint> ck = examples::read_train_checkpoint(ckpts, job.device);
  absl::Status loaded = ck.status();
  if (absl::IsNotFound(loaded)) {
    loaded = absl::NotFoundError(
        absl::StrCat(loaded.message(), "; run once without --resume to create a checkpoint"));
  }
  if (ck.ok()) loaded = load_step(c, job, *ck, t);
  agree_on_resume(job, loaded);
  progress.note(absl::StrCat(
      "resumed from step ", ck->step, " (", ck->file, ", written by ", ck->world_size, " ranks)",
      job.restart_count > 0 ? absl::StrCat(" on restart ", job.restart_count) : "",
      t.opt.post_local ? absl::StrCat("; post-local SGD's averager at step ",
                                      t.opt.post_local->averager().step())
                       : ""));
  return static_cast<int>(ck->step);
}

namespace {

// Every rank agrees that every rank succeeded (a failure anywhere stops everyone, naming it).
void agree(const Job& job, const absl::Status& mine, const char* what) {
  const absl::Status all = comm::first_failure(job.world, mine);
  if (!mine.ok()) die(1, absl::StrCat(checkpoint_error(mine.message()), heartbeat_cause(mine)));
  if (absl::IsAborted(all)) {
    die_after_peer(1, absl::StrCat("checkpoint: ", all.message(), " to ", what, "; see its error"));
  }
  if (!all.ok()) {  // the agreement itself failed: a rank or the network is gone
    die(1, absl::StrCat("checkpoint: rank ", job.rank, ": ", all.message(), heartbeat_cause(all)));
  }
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
  } else if (c.checkpoint_format == "dcp") {
    ckpt.insert("optimizer_dcp", std::string(kDcpDir));
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
  const char* own_dir = c.sharded_checkpoint           ? kShardDir
                        : c.checkpoint_format == "dcp" ? kDcpDir
                                                       : nullptr;
  if (job.rank == 0 && step_dir.ok() && own_dir != nullptr) {
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(*step_dir) / own_dir, ec);
    if (ec)
      step_dir = absl::UnavailableError(
          absl::StrCat("cannot create ", *step_dir, "/", own_dir, ": ", ec.message()));
  }
  agree(job, step_dir.status(), "create the step directory");
  step_dir = ckpts.dir_of(step);
  c10::IValue optimizer_state;
  if (c.sharded_checkpoint) {
    absl::Status s =
        t.opt.zero->save_sharded((std::filesystem::path(*step_dir) / kShardDir).string(),
                                 c10::IValue(static_cast<int64_t>(step)));
    if (!s.ok()) {
      die(1, absl::StrCat(checkpoint_error(s.message()), " (rank ", job.rank, ")",
                          heartbeat_cause(s)));
    }
  } else if (c.checkpoint_format == "dcp") {
    absl::Status s =
        save_train_dcp(job, t, step, (std::filesystem::path(*step_dir) / kDcpDir).string());
    if (!s.ok()) {
      die(1, absl::StrCat(checkpoint_error(s.message()), " (rank ", job.rank, ")",
                          heartbeat_cause(s)));
    }
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
