#include "examples/train_job.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <thread>
#include <vector>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/agreement.h"
#include "comm/exception_status.h"
#include "comm/heartbeat.h"
#include "ddp_hooks/zero_hook.h"
#include "examples/train_checkpoint.h"
#include "optim/model_averagers.h"

namespace dtrain::examples {

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
  return absl::StartsWith(message, "checkpoint") ? std::string(message)
                                                 : absl::StrCat("checkpoint: ", message);
}

// Names the rank that stopped when a collective fails (see main's error handler).
namespace {
std::unique_ptr<comm::Heartbeat> g_heartbeat;
}  // namespace

namespace {

std::string heartbeat_stalls() {
  return g_heartbeat == nullptr ? "" : absl::StrCat("; ", g_heartbeat->describe_stalls());
}

// Whether a message is a collective's or its transport's (see heartbeat_cause).
bool is_communication_failure(absl::string_view what) {
  // std::string_view from its parts: absl::string_view is a type of its own on some Abseils.
  if (comm::is_timeout_message(std::string_view(what.data(), what.size()))) return true;
  for (absl::string_view word :
       {"gloo", "Gloo", "NCCL", "nccl", "onnection", "peer", "Broken pipe", "ocket",
        "broadcast_object", "gather_object", "agreeing whether every rank"}) {
    if (absl::StrContains(what, word)) return true;
  }
  return false;
}

}  // namespace

std::string heartbeat_cause(const std::exception& e) {
  const bool dist = dynamic_cast<const c10::DistError*>(&e) != nullptr;
  return dist || is_communication_failure(e.what()) ? heartbeat_stalls() : "";
}

std::string heartbeat_cause(const absl::Status& s) {
  return !s.ok() && is_communication_failure(s.message()) ? heartbeat_stalls() : "";
}

torch::Generator generator(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

namespace {

torch::nn::Sequential make_mlp(int64_t hidden, torch::Generator& gen) {
  torch::nn::Sequential mlp(torch::nn::Linear(kIn, hidden), torch::nn::GELU(),
                            torch::nn::Linear(hidden, hidden), torch::nn::GELU(),
                            torch::nn::Linear(hidden, hidden), torch::nn::GELU(),
                            torch::nn::Linear(hidden, kOut));
  torch::NoGradGuard no_grad;
  for (auto& p : mlp->parameters()) {
    const double fan_in =
        p.dim() == 2 ? static_cast<double>(p.size(1)) : static_cast<double>(hidden);
    p.copy_(torch::randn(p.sizes(), gen) / std::sqrt(fan_in));
  }
  return mlp;
}

// Where this rank's model, data and optimizer state live: the NCCL group's GPU; with Gloo (which
// reduces CUDA tensors too) cuda:<LOCAL_RANK> as well; else the CPU.
c10::Device rank_device(const Config& c, const comm::Group& world) {
  if (!c.cuda()) return c10::Device(c10::kCPU);
  if (world.backend() == "nccl") return world.device();
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (world.local_rank() >= gpus) {
    die(2,
        absl::StrCat(
            "--device=cuda: this rank's GPU is cuda:", world.local_rank(), " (LOCAL_RANK) but ",
            gpus,
            " GPU(s) are visible; run at most one rank per GPU on each host, or use --device=cpu"));
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(world.local_rank()));
}

}  // namespace

Job join_job(const Config& c) {
  comm::InitOptions init;
  init.init_method = "env://";
  init.backend = c.backend;  // nccl: on cuda:<LOCAL_RANK> (InitOptions::device_id -1), made current
  init.timeout = std::chrono::seconds(c.timeout_s);
  init.rendezvous_timeout = std::chrono::seconds(c.rendezvous_timeout_s);
  absl::StatusOr<comm::Group> joined = comm::init_process_group(init);
  if (!joined.ok()) die(2, absl::StrCat("cannot join the job: ", joined.status().message()));
  Job job;
  job.world = *joined;
  g_heartbeat = std::make_unique<comm::Heartbeat>(job.world);
  job.rank = job.world.rank();
  job.world_size = job.world.size();
  job.device = rank_device(c, job.world);
  job.on_group = torch::TensorOptions().device(job.world.device());
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  job.restart_count = restarts != nullptr ? std::atoi(restarts) : 0;
  const char* run_id = std::getenv("TORCHELASTIC_RUN_ID");
  job.run_id = run_id != nullptr ? run_id : "";
  return job;
}

// Rank 0's progress display: redrawn in place when rank 0's stdout is a terminal.
Progress make_progress(const Config& c, const Job& job) {
  std::vector<at::Tensor> tty = {
      torch::full({1}, job.rank == 0 && ::isatty(1) == 1 ? 1 : 0, job.on_group.dtype(torch::kInt))};
  job.world->broadcast(tty, c10d::BroadcastOptions())->wait();
  return Progress(job.rank == 0, tty[0].item<int>() == 1, c.steps, c.log_every);
}

// Before the first step: every rank that saves (rank 0, every rank with hook state or shards) can
// write in --checkpoint_dir, on its own host (a local launch checked it before starting them).
void check_checkpoint_dir_everywhere(const Config& c, const Job& job) {
  if (c.checkpoint_dir.empty()) return;
  const bool writes =
      job.rank == 0 || c.hook == "powersgd" || c.sharded_checkpoint || c.checkpoint_format == "dcp";
  const absl::Status usable =
      writes ? examples::check_checkpoint_dir(c.checkpoint_dir) : absl::OkStatus();
  const absl::Status all = comm::first_failure(job.world, usable);
  // "rank R:" tells this rank's check (on its host) from the launching process's.
  if (!usable.ok()) die(2, absl::StrCat("rank ", job.rank, ": ", usable.message()));
  if (!all.ok()) {
    die_after_peer(
        2, absl::StrCat("rank ", job.rank, ": stopping before the first step: ", all.message(),
                        " to use --checkpoint_dir=", c.checkpoint_dir, " (see its error)"));
  }
}

void make_models(const Config& c, const Job& job, Trainer& t) {
  torch::Generator init_gen = generator(c.seed);
  t.teacher = make_mlp(64, init_gen);
  t.model = make_mlp(c.hidden, init_gen);
  for (auto& p : t.teacher->parameters()) p.set_requires_grad(false);
  if (job.device
          .is_cuda()) {  // drawn on the CPU as before, so every device starts from the same weights
    t.teacher->to(job.device);
    t.model->to(job.device);
  }
  ddp_hooks::DDPOptions o;
  o.group = job.world;
  o.gradient_as_bucket_view = c.bucket_view && c.zero != "stage2";  // stage2 frees the buckets
  // Small buckets for a small model: several of them overlap backward, and --zero_overlap has
  // buckets to spread over the ranks.
  o.bucket_cap_mb = 0.25;
  o.first_bucket_cap_mb = 0.25;
  t.ddp = std::make_unique<ddp_hooks::DistributedDataParallel>(t.model.ptr(), o);
}

// Adam, sharded by ZeRO (--zero), under post-local SGD (--hook=post_local_sgd), or plain.
void make_optimizer(const Config& c, const Job& job, Trainer& t) {
  optim::OptionsDict adam = optim::new_options_dict();
  adam.insert("lr", c.lr);
  if (!c.state_dtype.empty()) adam.insert("state_dtype", c.state_dtype);
  t.local_sgd_start = std::min(50, std::max(2, c.steps / 4));
  if (c.zero != "off") {
    optim::ZeroOptions zo;
    zo.group = job.world;
    zo.strategy = c.zero == "flat" ? optim::PartitionStrategy::kFlat
                                   : optim::PartitionStrategy::kSortedGreedy;
    zo.parameters_as_bucket_view = c.bucket_view;
    zo.overlap_with_ddp = c.zero_overlap;
    zo.shard_gradients = c.zero == "stage2";
    t.opt.zero = std::make_unique<optim::ZeroRedundancyOptimizer>(
        t.model->parameters(),
        optim::local_optimizer<optim::FunctionalOptimizerAdapter>("Adam", adam), zo);
  } else if (c.hook == "post_local_sgd") {
    auto local =
        std::make_unique<optim::FunctionalOptimizerAdapter>(t.model->parameters(), "Adam", adam);
    auto averager = std::make_shared<optim::PeriodicModelAverager>(4, t.local_sgd_start, job.world);
    t.opt.post_local = std::make_unique<optim::PostLocalSGDOptimizer>(std::move(local), averager);
  } else {
    t.opt.adam =
        std::make_unique<optim::FunctionalOptimizerAdapter>(t.model->parameters(), "Adam", adam);
  }
}

// --hook's communication hook (keeping its state in `t` where it has one), wrapped for ZeRO's
// overlap or replaced by ZeRO-2's, registered with DDP.
void register_hook(const Config& c, const Job& job, Trainer& t) {
  std::unique_ptr<c10d::CommHookInterface> hook;
  if (c.hook == "allreduce") {
    hook = std::make_unique<ddp_hooks::AllReduceHook>(job.world);
  } else if (c.hook == "fp16" || c.hook == "bf16") {
    hook = std::make_unique<ddp_hooks::CompressHook>(job.world,
                                                     c.hook == "fp16" ? at::kHalf : at::kBFloat16);
  } else if (c.hook == "powersgd") {
    // Its start is its own flag, not --steps: its state refuses a checkpoint written with another.
    t.powersgd = std::make_shared<ddp_hooks::PowerSGDState>(job.world);
    t.powersgd->matrix_approximation_rank = 8;
    t.powersgd->start_powerSGD_iter = c.powersgd_start_iter;
    hook = std::make_unique<ddp_hooks::PowerSGDHook>(t.powersgd);
  } else if (c.hook == "post_local_sgd") {
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    const int local_world = local != nullptr ? std::atoi(local) : job.world_size;
    absl::StatusOr<comm::Subgroups> sub =
        comm::new_subgroups(job.world, local_world > 0 ? local_world : job.world_size);
    if (!sub.ok()) die(2, absl::StrCat("post_local_sgd subgroups: ", sub.status().message()));
    t.post_local =
        std::make_shared<ddp_hooks::PostLocalSGDState>(job.world, sub->mine, t.local_sgd_start);
    hook = std::make_unique<ddp_hooks::PostLocalSGDHook>(t.post_local);
  } else {
    hook = std::make_unique<ddp_hooks::NoOpHook>();
  }
  if (c.zero_overlap) hook = ddp_hooks::hook_with_zero_step(std::move(hook), *t.ddp, *t.opt.zero);
  if (c.zero == "stage2") hook = ddp_hooks::hook_with_zero2(*t.ddp, *t.opt.zero);
  t.ddp->register_comm_hook(std::move(hook));
}

}  // namespace dtrain::examples
