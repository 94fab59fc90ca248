// The main job: a real multi-rank training run with DDP, a communication hook,
// ZeroRedundancyOptimizer(Adam) and checkpoints.
//
//   ./bazelw run //examples:train                         # 2 local ranks, defaults
//   ./bazelw run //examples:train -- --steps=600 --hook=powersgd --zero=flat
//   ./bazelw run //examples:train -- --resume             # continue from the latest checkpoint
//   ./bazelw run //examples:train -- --sharded_checkpoint # each rank saves its own optimizer shard
//   ./bazelw run //examples:train -- --device=cuda        # one GPU per rank (NCCL when built with it)
//   RANK=0 WORLD_SIZE=4 MASTER_ADDR=node0 MASTER_PORT=29500 bazel-bin/examples/train   # multi-node
//
// Without torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) the binary launches
// --nproc_per_node copies of itself on loopback; with them it is one rank of that job.
//
// The task: a student MLP learns a fixed random teacher MLP from data every rank generates for
// itself (deterministic per step and rank, so a resumed run sees the same batches). The flags and
// their checks are in train_config.h.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <c10/core/DeviceGuard.h>
#include <torch/cuda.h>
#include <torch/torch.h>  // and torch/version.h (TORCH_VERSION)

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/state_file.h"
#include "checkpoint/step_checkpoints.h"
#include "comm/heartbeat.h"
#include "comm/local_launcher.h"
#include "comm/process_group.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "ddp_hooks/powersgd_hook.h"
#include "ddp_hooks/zero_hook.h"
#include "examples/train_checkpoint.h"
#include "examples/train_config.h"
#include "examples/train_progress.h"
#include "optim/functional_adapter.h"
#include "optim/model_averagers.h"
#include "optim/post_local_sgd_optimizer.h"
#include "optim/torch_state.h"
#include "optim/zero_redundancy_optimizer.h"

namespace {

using namespace dtrain;  // NOLINT: an example reads better with short names

constexpr int64_t kIn = 32, kOut = 8;
using examples::kCheckpointFile;
using examples::kShardDir;
using examples::kib;
using examples::Progress;
using Config = examples::TrainConfig;
constexpr char kShardedNeedsZero[] =
    "--resume: this checkpoint's optimizer state is sharded (written with --sharded_checkpoint); resume with --zero";

// One-line errors for the user: "train: ..." and an exit code (2: usage, 1: runtime).
[[noreturn]] void die(int code, const std::string& message) {
  std::fprintf(stderr, "train: %s\n", message.c_str());
  std::exit(code);
}

// die() for a rank stopped by another's failure, after a moment for that rank's line (the cause).
[[noreturn]] void die_after_peer(int code, const std::string& message) {
  std::this_thread::sleep_for(std::chrono::seconds(1));
  die(code, message);
}

// "checkpoint: <message>", once: checkpoint/'s own messages already start with "checkpoint".
std::string checkpoint_error(absl::string_view message) {
  return absl::StartsWith(message, "checkpoint") ? std::string(message) : absl::StrCat("checkpoint: ", message);
}

torch::nn::Sequential make_mlp(int64_t hidden, torch::Generator& gen) {
  torch::nn::Sequential mlp(torch::nn::Linear(kIn, hidden), torch::nn::GELU(), torch::nn::Linear(hidden, hidden),
                            torch::nn::GELU(), torch::nn::Linear(hidden, hidden), torch::nn::GELU(),
                            torch::nn::Linear(hidden, kOut));
  torch::NoGradGuard no_grad;
  for (auto& p : mlp->parameters()) {
    const double fan_in = p.dim() == 2 ? static_cast<double>(p.size(1)) : static_cast<double>(hidden);
    p.copy_(torch::randn(p.sizes(), gen) / std::sqrt(fan_in));
  }
  return mlp;
}

torch::Generator generator(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

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

// Names the rank that stopped when a collective fails (see main's error handler).
std::unique_ptr<comm::Heartbeat> g_heartbeat;

// What the heartbeats say, for an error message: "; rank 1 stopped responding (...)", or "".
std::string stalls() {
  return g_heartbeat == nullptr ? "" : absl::StrCat("; ", g_heartbeat->describe_stalls());
}

// Where this rank's model, data and optimizer state live: the NCCL group's GPU; with Gloo (which
// reduces CUDA tensors too) cuda:<LOCAL_RANK> as well; else the CPU.
c10::Device rank_device(const Config& c, const comm::Group& world) {
  if (!c.cuda()) return c10::Device(c10::kCPU);
  if (world.backend() == "nccl") return world.device();
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (world.local_rank() >= gpus) {
    die(2, absl::StrCat("--device=cuda: this rank's GPU is cuda:", world.local_rank(), " (LOCAL_RANK) but ", gpus,
                        " GPU(s) are visible; run at most one rank per GPU on each host, or use --device=cpu"));
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(world.local_rank()));
}

int train(const Config& c) {
  comm::InitOptions init;
  init.init_method = "env://";
  init.backend = c.backend;  // nccl: on cuda:<LOCAL_RANK> (InitOptions::device_id -1), made current
  init.timeout = std::chrono::seconds(c.timeout_s);
  init.rendezvous_timeout = std::chrono::seconds(c.rendezvous_timeout_s);
  absl::StatusOr<comm::Group> joined = comm::init_process_group(init);
  if (!joined.ok()) die(2, absl::StrCat("cannot join the job: ", joined.status().message()));
  comm::Group world = *joined;
  g_heartbeat = std::make_unique<comm::Heartbeat>(world);
  const int rank = world.rank(), world_size = world.size();
  const c10::Device device = rank_device(c, world);
  // Until train() returns, allocations and kernels without a device index use this rank's GPU.
  c10::OptionalDeviceGuard current_device(device.is_cuda() ? std::optional<c10::Device>(device) : std::nullopt);
  // The small tensors of train()'s own collectives: on the group's device (NCCL's GPU, else the CPU).
  const torch::TensorOptions on_group = torch::TensorOptions().device(world.device());
  std::vector<at::Tensor> tty = {torch::full({1}, rank == 0 && ::isatty(1) == 1 ? 1 : 0, on_group.dtype(torch::kInt))};
  c10d::BroadcastOptions from_rank0;
  world->broadcast(tty, from_rank0)->wait();
  Progress progress(rank == 0, tty[0].item<int>() == 1, c.steps, c.log_every);
  // Before the first step: every rank that saves (rank 0, every rank with hook state or shards) can
  // write in --checkpoint_dir, on its own host (a local launch checked it before starting them).
  if (!c.checkpoint_dir.empty()) {
    const bool writes = rank == 0 || c.hook == "powersgd" || c.sharded_checkpoint;
    const absl::Status usable = writes ? examples::check_checkpoint_dir(c.checkpoint_dir) : absl::OkStatus();
    std::vector<at::Tensor> first = {torch::full({1}, usable.ok() ? world_size : rank, on_group.dtype(torch::kInt))};
    c10d::AllreduceOptions min;
    min.reduceOp = c10d::ReduceOp::MIN;
    world->allreduce(first, min)->wait();
    if (!usable.ok()) die(2, std::string(usable.message()));
    if (const int bad = first[0].item<int>(); bad < world_size) {
      die_after_peer(2, absl::StrCat("rank ", rank, ": stopping before the first step: rank ", bad,
                                     " cannot write in --checkpoint_dir=", c.checkpoint_dir, " (see its error)"));
    }
  }

  torch::Generator init_gen = generator(c.seed);
  torch::nn::Sequential teacher = make_mlp(64, init_gen);
  torch::nn::Sequential model = make_mlp(c.hidden, init_gen);
  for (auto& p : teacher->parameters()) p.set_requires_grad(false);
  if (device.is_cuda()) {  // drawn on the CPU as before, so every device starts from the same weights
    teacher->to(device);
    model->to(device);
  }

  ddp_hooks::DDPOptions ddp_options;
  ddp_options.group = world;
  ddp_options.gradient_as_bucket_view = c.bucket_view && c.zero != "stage2";  // stage2 frees the buckets
  // Small buckets for a small model: several of them overlap backward, and --zero_overlap has
  // buckets to spread over the ranks.
  ddp_options.bucket_cap_mb = 0.25;
  ddp_options.first_bucket_cap_mb = 0.25;
  ddp_hooks::DistributedDataParallel ddp(model.ptr(), ddp_options);

  optim::OptionsDict adam_options = optim::new_options_dict();
  adam_options.insert("lr", c.lr);
  Optimizer opt;
  std::shared_ptr<ddp_hooks::PowerSGDState> powersgd;
  std::shared_ptr<ddp_hooks::PostLocalSGDState> post_local;
  // Post-local SGD's switch to local steps follows --steps; PowerSGD's start is its own flag
  // (--powersgd_start_iter), not --steps: its state refuses a checkpoint written with another.
  const int64_t local_sgd_start = std::min(50, std::max(2, c.steps / 4));
  if (c.zero != "off") {
    optim::ZeroOptions zo;
    zo.group = world;
    zo.strategy = c.zero == "flat" ? optim::PartitionStrategy::kFlat : optim::PartitionStrategy::kSortedGreedy;
    zo.parameters_as_bucket_view = c.bucket_view;
    zo.overlap_with_ddp = c.zero_overlap;
    zo.shard_gradients = c.zero == "stage2";
    opt.zero = std::make_unique<optim::ZeroRedundancyOptimizer>(
        model->parameters(), optim::local_optimizer<optim::FunctionalOptimizerAdapter>("Adam", adam_options), zo);
  } else if (c.hook == "post_local_sgd") {
    auto local = std::make_unique<optim::FunctionalOptimizerAdapter>(model->parameters(), "Adam", adam_options);
    auto averager = std::make_shared<optim::PeriodicModelAverager>(4, local_sgd_start, world);
    opt.post_local = std::make_unique<optim::PostLocalSGDOptimizer>(std::move(local), averager);
  } else {
    opt.adam = std::make_unique<optim::FunctionalOptimizerAdapter>(model->parameters(), "Adam", adam_options);
  }

  std::unique_ptr<c10d::CommHookInterface> hook;
  if (c.hook == "allreduce") {
    hook = std::make_unique<ddp_hooks::AllReduceHook>(world);
  } else if (c.hook == "fp16" || c.hook == "bf16") {
    hook = std::make_unique<ddp_hooks::CompressHook>(world, c.hook == "fp16" ? at::kHalf : at::kBFloat16);
  } else if (c.hook == "powersgd") {
    powersgd = std::make_shared<ddp_hooks::PowerSGDState>(world);
    powersgd->matrix_approximation_rank = 8;
    powersgd->start_powerSGD_iter = c.powersgd_start_iter;
    hook = std::make_unique<ddp_hooks::PowerSGDHook>(powersgd);
  } else if (c.hook == "post_local_sgd") {
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    const int local_world = local != nullptr ? std::atoi(local) : world_size;
    absl::StatusOr<comm::Subgroups> sub = comm::new_subgroups(world, local_world > 0 ? local_world : world_size);
    if (!sub.ok()) die(2, absl::StrCat("post_local_sgd subgroups: ", sub.status().message()));
    post_local = std::make_shared<ddp_hooks::PostLocalSGDState>(world, sub->mine, local_sgd_start);
    hook = std::make_unique<ddp_hooks::PostLocalSGDHook>(post_local);
  } else {
    hook = std::make_unique<ddp_hooks::NoOpHook>();
  }
  if (c.zero_overlap) hook = ddp_hooks::hook_with_zero_step(std::move(hook), ddp, *opt.zero);
  if (c.zero == "stage2") hook = ddp_hooks::hook_with_zero2(ddp, *opt.zero);
  ddp.register_comm_hook(std::move(hook));

  // Resume: the model and the global optimizer state from the shared checkpoint (any world
  // size), the hook's per-rank state when it was saved at this world size.
  int start = 0;
  const std::filesystem::path dir = c.checkpoint_dir;  // step-N directories, `latest`, checkpoint.pt
  checkpoint::StepCheckpoints ckpts(dir.string(), c.keep_checkpoints);
  // A restarted attempt (--max_restarts, or torchrun's) continues from the newest step this job
  // (TORCHELASTIC_RUN_ID, written into every checkpoint) committed; a step left in the directory
  // by an earlier job is not this job's state, so without one the attempt starts afresh.
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const int restart_count = restarts != nullptr ? std::atoi(restarts) : 0;
  const char* run_id_env = std::getenv("TORCHELASTIC_RUN_ID");
  const std::string run_id = run_id_env != nullptr ? run_id_env : "";
  bool restarted = false;
  if (restart_count > 0 && !c.resume && !c.checkpoint_dir.empty() && !absl::IsNotFound(ckpts.latest().status())) {
    absl::StatusOr<examples::TrainCheckpoint> last = examples::read_train_checkpoint(ckpts);
    restarted = !last.ok() || run_id.empty() || last->run_id == run_id;  // no run id: cannot tell, resume
    if (!restarted) {
      progress.note(absl::StrCat("restart ", restart_count, ": no step of this job was committed in ",
                                 c.checkpoint_dir, " (its newest is another job's); starting from step 0"));
    }
  }
  if (c.resume || restarted) {
    // The newest committed step: every file of it (model, optimizer or its shards, hook states)
    // is in its step directory, so nothing can come from different steps. Its tensors are read
    // onto this rank's device (CPU in the file, whatever device wrote it).
    absl::StatusOr<examples::TrainCheckpoint> ck = examples::read_train_checkpoint(ckpts, device);
    if (!ck.ok()) {
      die(2, absl::StrCat("--resume: ", ck.status().message(), absl::IsNotFound(ck.status())
                              ? "; run once without --resume to create a checkpoint" : ""));
    }
    start = static_cast<int>(ck->step);
    if (absl::Status s = examples::load_weights(ck->model, *model); !s.ok()) die(2, absl::StrCat("--resume: ", s.message()));
    if (!ck->sharded) {
      opt.load_state_dict(ck->optimizer);
    } else if (!opt.zero) {
      die(2, kShardedNeedsZero);
    } else {
      // Each rank reads only the pieces of the shards it owns now.
      absl::StatusOr<c10::IValue> saved_step = opt.zero->load_sharded((std::filesystem::path(ck->dir) / kShardDir).string());
      if (!saved_step.ok()) die(2, absl::StrCat("--resume: ", saved_step.status().message()));
      if (!saved_step->isInt() || saved_step->toInt() != start) {
        die(2, absl::StrCat("--resume: the optimizer shards in ", ck->dir, " are not from step ", start));
      }
    }
    if (post_local) post_local->iter = start;
    if (powersgd && ck->world_size == world_size && ck->hook == c.hook) {
      const std::string file = examples::hook_file(ck->dir, rank);
      absl::StatusOr<c10::IValue> hs = checkpoint::load_state(file);  // the hook moves it to the buckets' device
      if (!hs.ok()) die(2, absl::StrCat("--resume: ", hs.status().message()));
      // The hook counts one iteration per backward and train() runs one backward per step (from
      // step 0, or from a resumed step with `iter` set to it), so a state saved at step N has iter N.
      if (absl::Status s = powersgd->load_state_dict(*hs, ck->step); !s.ok()) {
        die(2, absl::StrCat("--resume: ", file, ": ", s.message(),
                            absl::StrContains(s.message(), "'start_powerSGD_iter'")
                                ? absl::StrCat("; it is --powersgd_start_iter (", c.powersgd_start_iter,
                                               " in this run): pass the value the checkpoint was written with")
                                : ""));
      }
    } else if (powersgd) {
      powersgd->iter = start;
    }
    progress.note(absl::StrCat("resumed from step ", start, " (", ck->file, ", written by ", ck->world_size, " ranks)",
                               restart_count > 0 ? absl::StrCat(" on restart ", restart_count) : ""));
    if (start >= c.steps) {
      progress.note(absl::StrCat("the checkpoint is at step ", start, ", at or past --steps=", c.steps,
                                 "; nothing to train (raise --steps)"));
      return 0;
    }
  }

  // Every rank agrees that every rank succeeded (a failure anywhere stops everyone, naming it).
  auto agree = [&](const absl::Status& mine, const char* what) {
    std::vector<at::Tensor> ok = {torch::full({1}, mine.ok() ? 1 : 0, on_group.dtype(torch::kInt))};
    c10d::AllreduceOptions min;
    min.reduceOp = c10d::ReduceOp::MIN;
    world->allreduce(ok, min)->wait();
    if (!mine.ok()) die(1, checkpoint_error(mine.message()));
    if (ok[0].item<int>() == 0) {
      die_after_peer(1, absl::StrCat("checkpoint: another rank failed to ", what, "; see its error"));
    }
  };
  auto save = [&](int step) {
    // One step directory, committed by rank 0 only after every rank wrote its part: a crash
    // anywhere before the commit leaves the previous step current and complete.
    absl::StatusOr<std::string> step_dir = std::string();
    if (rank == 0) step_dir = ckpts.begin(step);
    if (rank == 0 && step_dir.ok() && c.sharded_checkpoint) {
      std::error_code ec;
      std::filesystem::create_directories(std::filesystem::path(*step_dir) / kShardDir, ec);
      if (ec) step_dir = absl::UnavailableError(absl::StrCat("cannot create ", *step_dir, "/", kShardDir, ": ", ec.message()));
    }
    agree(step_dir.status(), "create the step directory");
    step_dir = ckpts.dir_of(step);
    c10::IValue optimizer_state;
    if (c.sharded_checkpoint) {
      absl::Status s = opt.zero->save_sharded((std::filesystem::path(*step_dir) / kShardDir).string(),
                                              c10::IValue(static_cast<int64_t>(step)));
      if (!s.ok()) die(1, checkpoint_error(s.message()));
    } else {
      optimizer_state = opt.global_state_dict();
    }
    absl::Status hook_saved;
    if (powersgd) hook_saved = checkpoint::save_state(examples::hook_file(*step_dir, rank), powersgd->state_dict());
    agree(hook_saved, "write its hook state");
    if (rank != 0) return;
    c10::impl::GenericDict weights(c10::StringType::get(), c10::AnyType::get());
    for (const auto& item : model->named_parameters()) weights.insert(item.key(), item.value().detach().clone());
    c10::impl::GenericDict ckpt(c10::StringType::get(), c10::AnyType::get());
    ckpt.insert("step", static_cast<int64_t>(step));
    ckpt.insert("world_size", static_cast<int64_t>(world_size));
    ckpt.insert("model", weights);
    if (c.sharded_checkpoint) {
      ckpt.insert("optimizer_shards", std::string(kShardDir));
    } else {
      ckpt.insert("optimizer", optimizer_state);
    }
    ckpt.insert("hook", c.hook);
    ckpt.insert("zero", c.zero);
    if (!run_id.empty()) ckpt.insert("run_id", run_id);
    absl::Status s = checkpoint::save_state((std::filesystem::path(*step_dir) / kCheckpointFile).string(), ckpt);
    if (s.ok()) s = ckpts.commit(step);
    if (!s.ok()) die(1, checkpoint_error(s.message()));
  };

  const auto t0 = std::chrono::steady_clock::now();
  double first_loss = NAN, last_loss = NAN;
  int64_t state = 0;
  for (int step = start + 1; step <= c.steps; ++step) {
    // The batch of (step, rank): the same whatever happened before, so resuming is exact.
    if (step == c.fail_at_step && rank == 1 && restart_count == 0) ::raise(SIGKILL);  // test-only crash
    torch::Generator data_gen = generator(c.seed * 1000003 + static_cast<uint64_t>(step) * 4099 + rank);
    const torch::Tensor x = torch::randn({c.batch_size, kIn}, data_gen).to(device);  // drawn on the CPU
    torch::Tensor y;
    {
      torch::NoGradGuard no_grad;
      y = teacher->forward(x);
    }
    opt.get().zero_grad();
    torch::Tensor loss = ddp.forward([&] { return torch::mse_loss(model->forward(x), y); });
    loss.backward();
    opt.get().step();
    if (progress.due(step) || step == start + 1 || step == c.steps) {
      std::vector<at::Tensor> mean = {loss.detach().reshape({1}) / world_size};
      world->allreduce(mean)->wait();
      last_loss = mean[0].item<double>();
      if (std::isnan(first_loss)) first_loss = last_loss;
    }
    if (progress.due(step)) {
      if (state == 0 || step % 50 == 0) state = opt.local_state_bytes();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      progress.show(step, last_loss, (step - start) / seconds, state);
    }
    if (!c.checkpoint_dir.empty() && (step % c.checkpoint_every == 0 || step == c.steps)) save(step);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // Summary: optimizer state per rank next to one unsharded replica.
  std::vector<at::Tensor> mine = {torch::full({1}, opt.local_state_bytes(), on_group.dtype(torch::kLong))};
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < world_size; ++r) all[0].push_back(torch::zeros({1}, on_group.dtype(torch::kLong)));
  world->allgather(all, mine)->wait();
  int64_t total = 0;
  for (const auto& t : all[0]) total += t.item<int64_t>();
  const int64_t unsharded = c.zero == "off" ? all[0][0].item<int64_t>() : total;
  if (rank == 0) {
    // On the CPU the line is as it always was; on GPUs it names them and the backend.
    const std::string on = device.is_cuda() ? absl::StrCat(" on cuda (one GPU each, rank 0 on ", device.str(), ", ",
                                                           c.backend, ")") : "";
    std::printf("\n| run | %d ranks%s, hook %s, zero %s%s, bucket_view %s |\n|---|---|\n| LibTorch | %s |\n", world_size,
                on.c_str(), c.hook.c_str(), c.zero.c_str(), c.zero_overlap ? " (overlapped with DDP)" : "",
                c.bucket_view ? "on" : "off", TORCH_VERSION);
    std::printf("| loss | %.6f at step %d -> final loss %.6f at step %d |\n", first_loss, start + 1, last_loss, c.steps);
    std::printf("| time | %.2f s for %d steps (%.1f steps/s) |\n", seconds, c.steps - start, (c.steps - start) / seconds);
    for (int r = 0; r < world_size; ++r) {
      std::printf("| optimizer state, rank %d | %s |\n", r, kib(all[0][r].item<int64_t>()).c_str());
    }
    std::printf("| optimizer state, unsharded | %s (%.2fx of it on the largest rank) |\n", kib(unsharded).c_str(),
                static_cast<double>(torch::cat(all[0]).max().item<int64_t>()) / static_cast<double>(unsharded));
    if (!c.checkpoint_dir.empty()) {
      const std::string step_dir = ckpts.dir_of(c.steps);
      std::printf("| checkpoint | %s (step %d: %s)%s |\n", (dir / kCheckpointFile).c_str(), c.steps, step_dir.c_str(),
                  c.sharded_checkpoint ? absl::StrCat(", optimizer shards in ", step_dir, "/", kShardDir).c_str() : "");
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Trains a small MLP with DDP + a communication hook + ZeroRedundancyOptimizer(Adam) on local ranks it "
      "launches, or as one rank of a torchrun-style job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) die(2, absl::StrCat("unexpected argument '", rest[1], "'; flags look like --steps=100"));
  const absl::StatusOr<Config> flags = examples::read_flags();
  if (!flags.ok()) die(2, std::string(flags.status().message()));
  const Config& config = *flags;
  const bool in_job = std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr;
  if (!in_job) {
    // Checked once here, not by every rank; --checkpoint_dir too, before the ranks start (not at their first save).
    const int nproc = config.nproc_per_node;
    if (nproc < 1) die(2, absl::StrCat("--nproc_per_node must be at least 1, got ", nproc));
    if (config.cuda() && nproc > static_cast<int64_t>(torch::cuda::device_count())) {
      die(2, absl::StrCat("--device=cuda runs one rank per GPU: --nproc_per_node=", nproc, " needs ", nproc,
                          " GPUs but ", static_cast<int>(torch::cuda::device_count()),
                          " are visible; lower --nproc_per_node or check CUDA_VISIBLE_DEVICES"));
    }
    const std::string& dir = config.checkpoint_dir;
    const absl::Status usable = dir.empty() ? absl::OkStatus() : examples::check_checkpoint_dir(dir);
    if (!usable.ok()) die(2, std::string(usable.message()));
    if (config.resume) {
      absl::StatusOr<examples::TrainCheckpoint> ck =
          examples::read_train_checkpoint(checkpoint::StepCheckpoints(config.checkpoint_dir));
      if (!ck.ok()) {
        die(2, absl::StrCat("--resume: ", ck.status().message(), absl::IsNotFound(ck.status())
                                ? "; run once without --resume to create one" : ""));
      }
      if (ck->sharded && config.zero == "off") die(2, kShardedNeedsZero);
    }
    comm::LaunchOptions o;
    o.nproc_per_node = nproc;
    o.rank0_owns_terminal = true;
    o.max_restarts = config.max_restarts;
    o.rdzv_id = config.rdzv_id;
    std::vector<std::string> args = {"/proc/self/exe"};
    for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
    absl::StatusOr<int> code = comm::launch_local(args, o);
    if (!code.ok()) die(absl::IsInvalidArgument(code.status()) ? 2 : 1, std::string(code.status().message()));
    return *code;
  }
  try {
    return train(config);
  } catch (const c10::Error& e) {
    die(1, absl::StrCat("rank ", std::getenv("RANK") ? std::getenv("RANK") : "?", ": ", e.what_without_backtrace(),
                        stalls()));
  } catch (const std::exception& e) {
    die(1, absl::StrCat("rank ", std::getenv("RANK") ? std::getenv("RANK") : "?", ": ", e.what(), stalls()));
  }
}
