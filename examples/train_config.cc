#include "examples/train_config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <torch/cuda.h>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/process_group.h"
#include "launcher/launch_options.h"
#include "launcher/local_launcher.h"

// torchrun's flags (--nnodes, --node_rank, --master_addr, --master_port, --max_restarts, --rdzv_id)
// are launcher/launch_options.cc's, shared with //launcher:launch; --nproc_per_node is defined
// here, with its help text from there, for train's default of 2 ranks.
ABSL_FLAG(int64_t, nproc_per_node, 2, dtrain::comm::kNprocPerNodeHelp);
ABSL_FLAG(int, steps, 300,
          "Total optimizer steps, at least 1 (a resumed run continues up to this step).");
ABSL_FLAG(std::string, hook, "allreduce",
          "DDP communication hook: allreduce|fp16|bf16|powersgd|post_local_sgd|noop.");
ABSL_FLAG(std::string, zero, "sorted_greedy",
          "Optimizer sharding: off|sorted_greedy|flat|stage2 (ZeRO-2: grads too; needs "
          "--hook=allreduce).");
ABSL_FLAG(bool, zero_overlap, false,
          "Step ZeRO inside the DDP hook, bucket by bucket (needs --zero=sorted_greedy and "
          "--hook=allreduce|fp16|bf16).");
ABSL_FLAG(std::string, state_dtype, "",
          "Adam's optimizer state: empty (the parameters' dtype), bfloat16 (stochastic rounding) "
          "or 8bit (blockwise; not with --zero=flat|stage2).");
ABSL_FLAG(bool, bucket_view, true,
          "Gradients (DDP) and parameters (ZeRO) as views into communication buckets.");
ABSL_FLAG(std::string, checkpoint_dir, "/tmp/dtrain-train",
          "Where checkpoints go (created if missing; checked writable before the first step); "
          "empty: no checkpoints.");
ABSL_FLAG(int, checkpoint_every, 100,
          "Steps between checkpoints, at least 1 (and one at the end).");
ABSL_FLAG(int, keep_checkpoints, 2,
          "Committed steps kept in --checkpoint_dir, at least 1 (step-N directories; the newest "
          "is current).");
ABSL_FLAG(bool, resume, false,
          "Continue from the checkpoint in --checkpoint_dir (needs one; every rank checks what it "
          "loads and all stop together, naming the file, if one is bad).");
ABSL_FLAG(bool, sharded_checkpoint, false,
          "With ZeRO: every rank writes its own optimizer-state shard "
          "(--checkpoint_dir/optimizer/) instead of "
          "gathering the state on rank 0; resumable at any rank count and --zero strategy.");
ABSL_FLAG(std::string, checkpoint_format, "torch_save",
          "torch_save: checkpoint.pt holds the model and the optimizer (torch.load reads it); dcp: "
          "they go to --checkpoint_dir/step-N/dcp/, a torch.distributed.checkpoint directory "
          "every rank writes its own part of (dcp.load reads it at any world size).");
ABSL_FLAG(std::string, init_from_dcp, "",
          "Start from the model and optimizer of this torch.distributed.checkpoint directory "
          "(one PyTorch wrote with get_state_dict as {'model', 'optim'[, 'step']}, or a dcp/ "
          "directory of --checkpoint_format=dcp), at its 'step' (0 without one).");
ABSL_FLAG(double, lr, 3e-3, "Adam learning rate, positive and finite.");
ABSL_FLAG(int, batch_size, 64,
          "Samples per rank per step, 1-1048576 (--batch_size x --hidden at most 2^28).");
ABSL_FLAG(int, hidden, 256,
          "Width of the student's hidden layers, 1-16384 (16384: about 10 GiB per rank of "
          "weights, gradients and Adam's state).");
ABSL_FLAG(int, log_every, 0,
          "Steps between progress lines when stdout is not a terminal, at least 0; 0: steps / "
          "10.");
ABSL_FLAG(int, timeout_s, 60,
          "Seconds a collective may wait for the other ranks before the job fails, naming the rank "
          "that stopped; 1-604800 (a week).");
ABSL_FLAG(int, rendezvous_timeout_s, 300,
          "Seconds for every rank to join the job at startup (and, with --nnodes > 1 and "
          "--max_restarts, for every node's launcher to join each attempt); 1-604800 (a week).");
ABSL_FLAG(
    int, fail_at_step, 0,
    "Testing only: rank 1 kills itself (SIGKILL) before this step on the first attempt, at least "
    "0; 0: never.");
ABSL_FLAG(uint64_t, seed, 0, "Seed of the teacher, the student's initial weights and the data.");
ABSL_FLAG(std::string, device, "cpu",
          "Where the model, the data and the optimizer state live: cpu|cuda (cuda: each rank on "
          "cuda:<LOCAL_RANK>, "
          "one GPU per rank).");
ABSL_FLAG(std::string, backend, "auto",
          "Process group backend: auto|nccl|gloo (auto: nccl with --device=cuda in a build with "
          "NCCL, else gloo; "
          "gloo also reduces CUDA tensors).");
ABSL_FLAG(int, powersgd_start_iter, 50,
          "Steps of plain all-reduce before --hook=powersgd compresses (PowerSGD's "
          "start_powerSGD_iter, at least 2); "
          "a run resumes PowerSGD's state only with the value its checkpoint was written with.");

namespace dtrain::examples {
namespace {

absl::Status usage(const std::string& message) { return absl::InvalidArgumentError(message); }

// "--<name> must be in [lo, hi]<why>, got <value>", or OK.
absl::Status in_range(const char* name, int64_t value, int64_t lo, int64_t hi,
                      const std::string& why = "") {
  if (value >= lo && value <= hi) return absl::OkStatus();
  if (hi == std::numeric_limits<int>::max()) {
    return usage(absl::StrCat("--", name, " must be at least ", lo, why, ", got ", value));
  }
  return usage(absl::StrCat("--", name, " must be in [", lo, ", ", hi, "]", why, ", got ", value));
}

// Every number that sizes the run (memory, steps, time), bounded before anything is allocated.
absl::Status check_sizes(const TrainConfig& c) {
  constexpr int kAny = std::numeric_limits<int>::max();
  const std::string week = " (seconds; at most a week)";
  for (const absl::Status& s :
       {in_range("steps", c.steps, 1, kAny),
        in_range("hidden", c.hidden, 1, kMaxHidden,
                 " (the student's two hidden x hidden layers: 16384 is about 10 GiB per rank of "
                 "weights, gradients and Adam's state)"),
        in_range("batch_size", c.batch_size, 1, kMaxBatchSize),
        in_range("checkpoint_every", c.checkpoint_every, 1, kAny),
        in_range("log_every", c.log_every, 0, kAny),
        in_range("timeout_s", c.timeout_s, 1, kMaxTimeoutSeconds, week),
        in_range("rendezvous_timeout_s", c.rendezvous_timeout_s, 1, kMaxTimeoutSeconds, week)}) {
    if (!s.ok()) return s;
  }
  if (static_cast<int64_t>(c.batch_size) * c.hidden > kMaxActivations) {
    return usage(
        absl::StrCat("--batch_size x --hidden = ", static_cast<int64_t>(c.batch_size) * c.hidden,
                     " is more than ", kMaxActivations,
                     " (each hidden layer's activations, 1 GiB at that size); lower one of them"));
  }
  if (!(c.lr > 0) || !std::isfinite(c.lr))
    return usage(absl::StrCat("--lr must be positive and finite, got ", c.lr));
  return absl::OkStatus();
}

// The checks that need only the flags' values, in the order the messages were always given.
// --checkpoint_format and --init_from_dcp against the other flags.
absl::Status check_dcp_flags(const TrainConfig& c) {
  if (c.checkpoint_format != "torch_save" && c.checkpoint_format != "dcp") {
    return usage(absl::StrCat("unknown --checkpoint_format=", c.checkpoint_format,
                              "; choose torch_save|dcp"));
  }
  if (c.checkpoint_format == "dcp" && c.sharded_checkpoint) {
    return usage(
        "--checkpoint_format=dcp is sharded already (each rank writes its part): drop "
        "--sharded_checkpoint");
  }
  if (!c.init_from_dcp.empty() && c.resume) {
    return usage(
        "--init_from_dcp starts a run from a DCP checkpoint and --resume continues one "
        "from --checkpoint_dir: give one of them");
  }
  return absl::OkStatus();
}

// --state_dtype against the flags whose layouts it cannot use.
absl::Status check_state_dtype(const TrainConfig& c) {
  if (!c.state_dtype.empty() && c.state_dtype != "bfloat16" && c.state_dtype != "8bit") {
    return usage(
        absl::StrCat("--state_dtype must be empty, bfloat16 or 8bit, got '", c.state_dtype, "'"));
  }
  if (c.state_dtype == "8bit" && (c.zero == "flat" || c.zero == "stage2")) {
    return usage("--state_dtype=8bit quantises blocks of whole parameters, which --zero=" + c.zero +
                 " cuts into element ranges; use --zero=sorted_greedy or --state_dtype=bfloat16");
  }
  return absl::OkStatus();
}

absl::Status check_values(const TrainConfig& c, const std::string& backend) {
  const std::vector<std::string> hooks = {"allreduce", "fp16",           "bf16",
                                          "powersgd",  "post_local_sgd", "noop"};
  const std::vector<std::string> zeros = {"off", "sorted_greedy", "flat", "stage2"};
  const std::vector<std::string> devices = {"cpu", "cuda"};
  const std::vector<std::string> backends = {"auto", "nccl", "gloo"};
  auto known = [](const std::vector<std::string>& names, const std::string& name) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  if (!known(hooks, c.hook)) {
    return usage(
        absl::StrCat("unknown --hook=", c.hook, "; choose one of ", absl::StrJoin(hooks, "|")));
  }
  if (!known(zeros, c.zero)) {
    return usage(
        absl::StrCat("unknown --zero=", c.zero, "; choose one of ", absl::StrJoin(zeros, "|")));
  }
  if (absl::Status s = check_sizes(c); !s.ok()) return s;
  if (c.keep_checkpoints < 1) {
    return usage(absl::StrCat("--keep_checkpoints must be at least 1, got ", c.keep_checkpoints));
  }
  if (c.fail_at_step < 0)
    return usage(absl::StrCat("--fail_at_step must be at least 0, got ", c.fail_at_step));
  if (c.hook == "post_local_sgd" && c.zero != "off") {
    return usage(
        "--hook=post_local_sgd lets ranks drift apart between averagings, which ZeRO's parameter "
        "broadcast "
        "would undo; use it with --zero=off");
  }
  if (c.zero_overlap && (c.zero != "sorted_greedy" || c.hook == "powersgd" ||
                         c.hook == "post_local_sgd" || c.hook == "noop")) {
    return usage("--zero_overlap needs --zero=sorted_greedy and --hook=allreduce|fp16|bf16");
  }
  if (c.zero == "stage2" && c.hook != "allreduce") {
    return usage("--zero=stage2 reduce-scatters gradients: use --hook=allreduce");
  }
  if (absl::Status s = check_state_dtype(c); !s.ok()) return s;
  if (c.resume && c.checkpoint_dir.empty()) return usage("--resume needs a --checkpoint_dir");
  if (absl::Status s = check_dcp_flags(c); !s.ok()) return s;
  if (c.sharded_checkpoint && c.zero == "off") {
    return usage(
        "--sharded_checkpoint shards ZeRO's optimizer state; use it with --zero=sorted_greedy or "
        "--zero=flat");
  }
  // The flags added with CUDA support.
  if (!known(devices, c.device)) {
    return usage(absl::StrCat("unknown --device=", c.device, "; choose one of ",
                              absl::StrJoin(devices, "|")));
  }
  if (!known(backends, backend)) {
    return usage(absl::StrCat("unknown --backend=", backend, "; choose one of ",
                              absl::StrJoin(backends, "|")));
  }
  if (backend == "nccl" && !c.cuda()) {
    return usage(
        "--backend=nccl reduces tensors on GPUs only; use it with --device=cuda, or use "
        "--backend=gloo "
        "(or auto) with --device=cpu");
  }
  if (c.powersgd_start_iter < 2) {
    return usage(absl::StrCat(
        "--powersgd_start_iter must be at least 2 (PowerSGD's error feedback and warm start "
        "need two plain all-reduce steps first), got ",
        c.powersgd_start_iter));
  }
  return absl::OkStatus();
}

// --device=cuda: CUDA in this build, and a GPU this process can see.
absl::Status check_cuda() {
  if (!comm::nccl_available()) {
    return usage(
        "--device=cuda: this build has no CUDA (the LibTorch it was built against has no "
        "libtorch_cuda.so); "
        "rebuild with LIBTORCH_HOME pointing at a CUDA LibTorch, or use --device=cpu");
  }
  if (!torch::cuda::is_available()) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    return usage(absl::StrCat(
        "--device=cuda: no GPU is visible to this process",
        visible != nullptr ? absl::StrCat(" (CUDA_VISIBLE_DEVICES=", visible, ")") : "",
        "; run it where one is (nvidia-smi lists them), check CUDA_VISIBLE_DEVICES, or use "
        "--device=cpu"));
  }
  return absl::OkStatus();
}

}  // namespace

void set_flags_usage() {
  absl::SetProgramUsageMessage(
      "Trains a small MLP with DDP + a communication hook + ZeroRedundancyOptimizer(Adam) on "
      "local ranks it launches, or as one rank of a torchrun-style job (RANK, WORLD_SIZE, "
      "MASTER_ADDR, MASTER_PORT; torchrun's flags are then checked but not used). With "
      "--max_restarts the ranks resume from the newest step this job committed (the job: "
      "--rdzv_id, recorded in each checkpoint).\n\n  train [--flag=value ...]     (--helpfull: "
      "Abseil's own flags too)");
  absl::FlagsUsageConfig config;
  // The flags of train.cc, train_config.cc and launcher/launch_options.cc (torchrun's), in --help
  // and --helpshort.
  auto train_file = [](absl::string_view file) {
    return absl::EndsWith(file, "examples/train_config.cc") ||
           absl::EndsWith(file, "examples/train.cc") || comm::defines_launch_flags(file);
  };
  config.contains_helpshort_flags = train_file;
  config.contains_help_flags = train_file;
  config.contains_helppackage_flags = train_file;
  absl::SetFlagsUsageConfig(config);
}

absl::StatusOr<TrainConfig> read_flags() {
  TrainConfig c;
  c.steps = absl::GetFlag(FLAGS_steps);
  c.hook = absl::GetFlag(FLAGS_hook);
  c.zero = absl::GetFlag(FLAGS_zero);
  c.zero_overlap = absl::GetFlag(FLAGS_zero_overlap);
  c.bucket_view = absl::GetFlag(FLAGS_bucket_view);
  c.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  c.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  c.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  c.resume = absl::GetFlag(FLAGS_resume);
  c.sharded_checkpoint = absl::GetFlag(FLAGS_sharded_checkpoint);
  c.checkpoint_format = absl::GetFlag(FLAGS_checkpoint_format);
  c.init_from_dcp = absl::GetFlag(FLAGS_init_from_dcp);
  c.lr = absl::GetFlag(FLAGS_lr);
  c.state_dtype = absl::GetFlag(FLAGS_state_dtype);
  c.batch_size = absl::GetFlag(FLAGS_batch_size);
  c.hidden = absl::GetFlag(FLAGS_hidden);
  c.log_every = absl::GetFlag(FLAGS_log_every);
  c.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  c.rendezvous_timeout_s = absl::GetFlag(FLAGS_rendezvous_timeout_s);
  c.fail_at_step = absl::GetFlag(FLAGS_fail_at_step);
  c.seed = absl::GetFlag(FLAGS_seed);
  c.device = absl::GetFlag(FLAGS_device);
  c.powersgd_start_iter = absl::GetFlag(FLAGS_powersgd_start_iter);
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (absl::Status s = check_values(c, backend); !s.ok()) return s;
  // torchrun's flags, checked where //launcher:launch checks them; the launchers' join timeout is
  // --rendezvous_timeout_s (checked above), at most theirs.
  comm::LaunchFlags launch = comm::read_launch_flags();
  launch.nproc_per_node = absl::GetFlag(FLAGS_nproc_per_node);
  launch.join_timeout_seconds =
      std::min<double>(c.rendezvous_timeout_s, comm::kMaxJoinTimeoutSeconds);
  absl::StatusOr<comm::LaunchOptions> o = comm::to_launch_options(launch);
  if (!o.ok()) return o.status();
  c.launch = *std::move(o);
  c.launch.rank0_owns_terminal = true;
  if (c.cuda()) {
    if (absl::Status s = check_cuda(); !s.ok()) return s;
  }
  c.backend = backend;
  if (backend == "auto") c.backend = c.cuda() && comm::nccl_available() ? "nccl" : "gloo";
  return c;
}

}  // namespace dtrain::examples
