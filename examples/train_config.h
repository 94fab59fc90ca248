// examples:train's command line: its flags (defined in train_config.cc), read into one struct and
// checked together, every problem one message that says what was wrong and what to do.
//
//   set_flags_usage();                                  // --help lists the flags below
//   std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
//   absl::StatusOr<TrainConfig> config = read_flags();
//   if (!config.ok()) die(2, config.status().message());   // "--steps must be at least 1, got 0"
//   if (config->cuda()) model->to(c10::Device(c10::kCUDA, local_rank));
#ifndef DTRAIN_EXAMPLES_TRAIN_CONFIG_H_
#define DTRAIN_EXAMPLES_TRAIN_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "launcher/local_launcher.h"

namespace dtrain::examples {

// The bounds of the flags that size the run, checked by read_flags() before anything is allocated.
inline constexpr int kMaxHidden = 16384;                      // --hidden
inline constexpr int kMaxBatchSize = 1 << 20;                 // --batch_size
inline constexpr int64_t kMaxActivations = int64_t{1} << 28;  // --batch_size x --hidden
inline constexpr int kMaxTimeoutSeconds = 7 * 24 * 3600;      // --timeout_s, --rendezvous_timeout_s

// One field per flag, under the flag's name (see train_config.cc for each flag's help text), but
// torchrun's flags: they are `launch`'s fields.
struct TrainConfig {
  // torchrun's flags, read and checked by launcher/launch_options.h, as the launcher takes them:
  // --nproc_per_node (here 2 by default; used by the launching process only), --nnodes,
  // --node_rank, --master_addr, --master_port, --max_restarts, --rdzv_id; join_timeout_seconds is
  // --rendezvous_timeout_s (at most comm::kMaxJoinTimeoutSeconds), rank 0 owns the terminal.
  comm::LaunchOptions launch;
  int steps = 300;
  std::string hook = "allreduce";      // allreduce|fp16|bf16|powersgd|post_local_sgd|noop
  std::string zero = "sorted_greedy";  // off|sorted_greedy|flat|stage2
  bool zero_overlap = false;
  bool bucket_view = true;
  std::string checkpoint_dir = "/tmp/dtrain-train";
  int checkpoint_every = 100;
  int keep_checkpoints = 2;
  bool resume = false;
  bool sharded_checkpoint = false;
  std::string checkpoint_format = "torch_save";  // torch_save|dcp
  std::string init_from_dcp;                     // a DCP directory to start from; "" none
  double lr = 3e-3;
  std::string state_dtype;  // Adam's state: "" (the parameters' dtype), "bfloat16" or "8bit"
  int batch_size = 64;
  int hidden = 256;
  int log_every = 0;
  int timeout_s = 60;
  int rendezvous_timeout_s = 300;
  int fail_at_step = 0;
  uint64_t seed = 0;
  // "cpu" or "cuda": where the model, the data and the optimizer state live (with "cuda", each
  // rank on cuda:<LOCAL_RANK>).
  std::string device = "cpu";
  // "nccl" or "gloo": --backend with "auto" resolved (nccl for --device=cuda in a build with
  // NCCL, else gloo).
  std::string backend = "gloo";
  // PowerSGD's start_powerSGD_iter (steps of plain all-reduce before --hook=powersgd compresses).
  int powersgd_start_iter = 50;

  bool cuda() const { return device == "cuda"; }
};

// Sets the usage message and makes --help and --helpshort list train's flags with their checks
// (Abseil's --help lists only the flags of the main file, train.cc, and these live in
// train_config.cc). Call before absl::ParseCommandLine.
void set_flags_usage();

// Reads every flag (call after absl::ParseCommandLine) and checks them, together and against this
// build and machine: --device=cuda needs a build with CUDA (comm::nccl_available()) and a visible
// GPU (how many GPUs --nproc_per_node needs is the launching process's check, and LOCAL_RANK's the
// rank's). Errors: InvalidArgument with the one-line message examples:train prints (exit code 2),
// e.g. an unknown --hook, --zero, --device or --backend, a value out of range (torchrun's flags
// with comm::to_launch_options' messages), flags that do not go together (--backend=nccl with
// --device=cpu), --device=cuda where no GPU can be used.
absl::StatusOr<TrainConfig> read_flags();

}  // namespace dtrain::examples

#endif  // DTRAIN_EXAMPLES_TRAIN_CONFIG_H_
