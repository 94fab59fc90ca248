// examples:train's checkpoints: what one step's checkpoint holds, read back and validated before
// anything is used (a checkpoint that passed its checksum can still be hostile or from another
// run: every field's type and range is checked, each problem is one Status naming the file).
//
//   checkpoint::StepCheckpoints ckpts(dir, keep);
//   absl::StatusOr<TrainCheckpoint> c = read_train_checkpoint(ckpts);   // the newest committed step
//   if (!c.ok()) die(2, c.status().message());
//   if (absl::Status s = load_weights(c->model, *model); !s.ok()) die(2, s.message());
//   if (absl::Status s = check_checkpoint_dir(dir); !s.ok()) die(2, s.message());   // before step 1
#ifndef DTRAIN_EXAMPLES_TRAIN_CHECKPOINT_H_
#define DTRAIN_EXAMPLES_TRAIN_CHECKPOINT_H_

#include <cstdint>
#include <string>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/step_checkpoints.h"

namespace dtrain::examples {

inline constexpr char kCheckpointFile[] = "checkpoint.pt";  // in each step directory
inline constexpr char kShardDir[] = "optimizer";  // in each step directory, --sharded_checkpoint
inline constexpr int64_t kMaxWorldSize = 1 << 20;

struct TrainCheckpoint {
  std::string dir;   // the step directory
  std::string file;  // dir/checkpoint.pt
  int64_t step = 0;  // equal to the directory's step
  int64_t world_size = 0;
  c10::impl::GenericDict model{c10::StringType::get(), c10::AnyType::get()};  // name -> tensor
  c10::IValue optimizer;  // PyTorch's optimizer state dict; None when sharded
  bool sharded = false;   // optimizer state in dir/optimizer (checkpoint/sharded.h)
  bool dcp = false;       // model and optimizer state in dir/dcp (examples/train_dcp.h)
  std::string hook;       // the --hook it was written with
  std::string run_id;     // TORCHELASTIC_RUN_ID of the job that wrote it ("" when none was set)
};

// The hook state file of `rank` in a step directory.
std::string hook_file(const std::string& step_dir, int rank);

// Reads and validates the newest committed step's checkpoint.pt, its tensors (model and optimizer
// state) put on `device` (torch.load's map_location: the file holds CPU tensors, whatever device
// wrote them). Errors: NotFound (nothing committed: run once without --resume), DataLoss/
// InvalidArgument naming the file and the field (wrong type, a step outside [0, 10^12] or not the
// directory's, a world size outside [1, 2^20], model entries that are not tensors), load_state's
// for a `device` this process cannot use or without memory for the tensors.
absl::StatusOr<TrainCheckpoint> read_train_checkpoint(const checkpoint::StepCheckpoints& ckpts,
                                                      c10::Device device = c10::Device(c10::kCPU));

// Checks, before the first step, that `dir` (--checkpoint_dir) can hold checkpoints on this host:
// it is a directory or can be created as one (it is created, parents too), and this process can
// create, write and remove a file in it (a probe named ".write-probe.tmp.*", which the next commit
// removes should this process be killed while it exists). Errors: FailedPrecondition, one line
// "--checkpoint_dir=<dir>: <problem>; <what to do>", the problem naming the path at fault: "it is a
// regular file, not a directory", "it cannot be created: <parent> is a regular file, not a
// directory", "it is a symbolic link to <target>, which does not exist" (or "it cannot be
// created: <ancestor> is a symbolic link ..."), "cannot create it: <OS error>", "cannot write in it (creating <probe> failed: <OS
// error>)".
absl::Status check_checkpoint_dir(const std::string& dir);

// Copies the saved weights into `model`'s parameters (from any device to theirs). Errors
// (InvalidArgument, naming the parameter): a parameter missing from the checkpoint, a different
// shape or dtype.
absl::Status load_weights(const c10::impl::GenericDict& weights, torch::nn::Module& model);

}  // namespace dtrain::examples

#endif  // DTRAIN_EXAMPLES_TRAIN_CHECKPOINT_H_
