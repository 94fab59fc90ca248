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
// their checks are in train_config.h; joining the job, the models, optimizer and hook in
// train_job.{h,cc}; resuming and saving a step in train_resume.cc; this file runs the steps.
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/DeviceGuard.h>
#include <torch/cuda.h>
#include <torch/torch.h>  // and torch/version.h (TORCH_VERSION)

#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/step_checkpoints.h"
#include "comm/process_group.h"
#include "examples/train_checkpoint.h"
#include "examples/train_config.h"
#include "examples/train_dcp.h"
#include "examples/train_job.h"
#include "examples/train_progress.h"
#include "launcher/local_launcher.h"

namespace {

using namespace dtrain;            // NOLINT: an example reads better with short names
using namespace dtrain::examples;  // NOLINT

struct RunResult {
  double first_loss = NAN, last_loss = NAN;
  double seconds = 0;
};

// Steps start+1..--steps: the batch of (step, rank) -- the same whatever happened before, so
// resuming is exact -- forward, backward through DDP, the optimizer's step, progress, checkpoints.
RunResult run_steps(const Config& c, const Job& job, checkpoint::StepCheckpoints& ckpts, Trainer& t,
                    Progress& progress, int start) {
  RunResult r;
  const auto t0 = std::chrono::steady_clock::now();
  int64_t state = 0;
  for (int step = start + 1; step <= c.steps; ++step) {
    if (step == c.fail_at_step && job.rank == 1 && job.restart_count == 0)
      ::raise(SIGKILL);  // test-only crash
    torch::Generator data_gen =
        generator(c.seed * 1000003 + static_cast<uint64_t>(step) * 4099 + job.rank);
    const torch::Tensor x =
        torch::randn({c.batch_size, kIn}, data_gen).to(job.device);  // drawn on the CPU
    torch::Tensor y;
    {
      torch::NoGradGuard no_grad;
      y = t.teacher->forward(x);
    }
    t.opt.get().zero_grad();
    torch::Tensor loss = t.ddp->forward([&] { return torch::mse_loss(t.model->forward(x), y); });
    loss.backward();
    t.opt.get().step();
    if (progress.due(step) || step == start + 1 || step == c.steps) {
      std::vector<at::Tensor> mean = {loss.detach().reshape({1}) / job.world_size};
      job.world->allreduce(mean)->wait();
      r.last_loss = mean[0].item<double>();
      if (std::isnan(r.first_loss)) r.first_loss = r.last_loss;
    }
    if (progress.due(step)) {
      if (state == 0 || step % 50 == 0) state = t.opt.local_state_bytes();
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      progress.show(step, r.last_loss, (step - start) / seconds, state);
    }
    if (!c.checkpoint_dir.empty() && (step % c.checkpoint_every == 0 || step == c.steps))
      save_step(c, job, ckpts, t, step);
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// FNV-1a over rank 0's parameters' bytes (in order): two runs that end with the same digest
// ended with the same weights, to the bit -- what the resume tests compare (the teacher task's
// loss reaches its floor and cannot tell two runs apart).
uint64_t weights_digest(torch::nn::Module& model) {
  uint64_t h = 1469598103934665603ULL;
  for (const auto& p : model.parameters()) {
    const at::Tensor t = p.detach().to(at::kCPU).contiguous();
    const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
    for (size_t i = 0; i < t.nbytes(); ++i) h = (h ^ bytes[i]) * 1099511628211ULL;
  }
  return h;
}

// Rank 0's summary table: the run, the loss, the speed, optimizer state per rank next to one
// unsharded replica, the checkpoint. Collective (gathers every rank's state size).
void print_summary(const Config& c, const Job& job, checkpoint::StepCheckpoints& ckpts, Trainer& t,
                   const RunResult& r, int start) {
  std::vector<at::Tensor> mine = {
      torch::full({1}, t.opt.local_state_bytes(), job.on_group.dtype(torch::kLong))};
  std::vector<std::vector<at::Tensor>> all(1);
  for (int i = 0; i < job.world_size; ++i)
    all[0].push_back(torch::zeros({1}, job.on_group.dtype(torch::kLong)));
  job.world->allgather(all, mine)->wait();
  int64_t total = 0;
  for (const auto& bytes : all[0]) total += bytes.item<int64_t>();
  const int64_t unsharded = c.zero == "off" ? all[0][0].item<int64_t>() : total;
  if (job.rank != 0) return;
  // On the CPU the line is as it always was; on GPUs it names them and the backend.
  const std::string on = job.device.is_cuda() ? absl::StrCat(" on cuda (one GPU each, rank 0 on ",
                                                             job.device.str(), ", ", c.backend, ")")
                                              : "";
  std::printf(
      "\n| run | %d ranks%s, hook %s, zero %s%s, bucket_view %s |\n|---|---|\n| LibTorch | %s |\n",
      job.world_size, on.c_str(), c.hook.c_str(), c.zero.c_str(),
      c.zero_overlap ? " (overlapped with DDP)" : "", c.bucket_view ? "on" : "off", TORCH_VERSION);
  std::printf("| loss | %.6f at step %d -> final loss %.6f at step %d |\n", r.first_loss, start + 1,
              r.last_loss, c.steps);
  std::printf("| weights digest | %016llx |\n",
              static_cast<unsigned long long>(weights_digest(*t.model)));
  std::printf("| time | %.2f s for %d steps (%.1f steps/s) |\n", r.seconds, c.steps - start,
              (c.steps - start) / r.seconds);
  for (int i = 0; i < job.world_size; ++i) {
    std::printf("| optimizer state, rank %d | %s |\n", i, kib(all[0][i].item<int64_t>()).c_str());
  }
  std::printf("| optimizer state, unsharded | %s (%.2fx of it on the largest rank) |\n",
              kib(unsharded).c_str(),
              static_cast<double>(torch::cat(all[0]).max().item<int64_t>()) /
                  static_cast<double>(unsharded));
  if (!c.checkpoint_dir.empty()) {
    const std::string step_dir = ckpts.dir_of(c.steps);
    const std::string file = (std::filesystem::path(c.checkpoint_dir) / kCheckpointFile).string();
    std::printf(
        "| checkpoint | %s (step %d: %s)%s |\n", file.c_str(), c.steps, step_dir.c_str(),
        c.sharded_checkpoint
            ? absl::StrCat(", optimizer shards in ", step_dir, "/", kShardDir).c_str()
        : c.checkpoint_format == "dcp"
            ? absl::StrCat(", model and optimizer in ", step_dir, "/", kDcpDir, " (DCP)").c_str()
            : "");
  }
  std::fflush(stdout);
}

int train_in(const Config& c, const Job& job) {
  // Until train_in() returns, allocations and kernels without a device index use this rank's GPU.
  c10::OptionalDeviceGuard current_device(
      job.device.is_cuda() ? std::optional<c10::Device>(job.device) : std::nullopt);
  Progress progress = make_progress(c, job);
  check_checkpoint_dir_everywhere(c, job);
  Trainer t;
  make_models(c, job, t);
  make_optimizer(c, job, t);
  register_hook(c, job, t);
  checkpoint::StepCheckpoints ckpts(c.checkpoint_dir,
                                    c.keep_checkpoints);  // step-N directories, `latest`
  const int start = resume(c, job, ckpts, t, progress);
  if (start >= c.steps) {
    progress.note(absl::StrCat("the checkpoint is at step ", start, ", at or past --steps=",
                               c.steps, "; nothing to train (raise --steps)"));
    return 0;
  }
  const RunResult r = run_steps(c, job, ckpts, t, progress, start);
  print_summary(c, job, ckpts, t, r, start);
  return 0;
}

int train(const Config& c) {
  const Job job = join_job(c);
  const int code = train_in(c, job);
  try {
    comm::destroy_process_group(job.world);  // after the trainer's hooks and DDP have gone
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train: rank %d: shutting the process group down failed: %s\n", job.rank,
                 e.what());
  }
  return code;
}

// Without torchrun's variables: checks what only the launching process can (ranks, GPUs, the
// checkpoint directory, a checkpoint to resume) and starts --nproc_per_node copies of this binary.
int launch_locally(const Config& config, int argc, char** argv) {
  // Checked once here, not by every rank; --checkpoint_dir too, before the ranks start (not at their first save).
  const int nproc = config.launch.nproc_per_node;  // in [1, 256]: read_flags checked it
  if (config.cuda() && nproc > static_cast<int64_t>(torch::cuda::device_count())) {
    die(2, absl::StrCat("--device=cuda runs one rank per GPU: --nproc_per_node=", nproc, " needs ",
                        nproc, " GPUs but ", static_cast<int>(torch::cuda::device_count()),
                        " are visible; lower --nproc_per_node or check CUDA_VISIBLE_DEVICES"));
  }
  const std::string& dir = config.checkpoint_dir;
  const absl::Status usable = dir.empty() ? absl::OkStatus() : examples::check_checkpoint_dir(dir);
  if (!usable.ok()) die(2, std::string(usable.message()));
  if (config.resume) {
    absl::StatusOr<examples::TrainCheckpoint> ck =
        examples::read_train_checkpoint(checkpoint::StepCheckpoints(config.checkpoint_dir));
    if (!ck.ok()) {
      die(2, absl::StrCat(
                 "--resume: ", ck.status().message(),
                 absl::IsNotFound(ck.status()) ? "; run once without --resume to create one" : ""));
    }
    if (ck->sharded && config.zero == "off") die(2, kShardedNeedsZero);
  }
  std::vector<std::string> args = {"/proc/self/exe"};
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  absl::StatusOr<int> code = comm::launch_local(args, config.launch);
  if (!code.ok())
    die(absl::IsInvalidArgument(code.status()) ? 2 : 1, std::string(code.status().message()));
  return *code;
}

}  // namespace

int main(int argc, char** argv) {
  examples::set_flags_usage();  // --help lists train's flags (they live in train_config.cc)
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1)
    die(2, absl::StrCat("unexpected argument '", rest[1], "'; flags look like --steps=100"));
  const absl::StatusOr<Config> flags = examples::read_flags();
  if (!flags.ok()) die(2, std::string(flags.status().message()));
  const Config& config = *flags;
  const bool in_job = std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr;
  if (!in_job) return launch_locally(config, argc, argv);
  try {
    return train(config);
  } catch (const c10::Error& e) {
    die(1, absl::StrCat("rank ", std::getenv("RANK") ? std::getenv("RANK") : "?", ": ",
                        e.what_without_backtrace(), heartbeat_cause(e)));
  } catch (const std::bad_alloc&) {
    die(1, absl::StrCat("rank ", std::getenv("RANK") ? std::getenv("RANK") : "?",
                        ": out of memory (std::bad_alloc); lower --hidden or --batch_size"));
  } catch (const std::exception& e) {
    die(1, absl::StrCat("rank ", std::getenv("RANK") ? std::getenv("RANK") : "?", ": ", e.what(),
                        heartbeat_cause(e)));
  }
}
