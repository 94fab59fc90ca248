// examples:train's torch.distributed.checkpoint (DCP) checkpoints: --checkpoint_format=dcp writes
// the model and Adam's state to <step directory>/dcp/ under get_state_dict's keys
// (checkpoint/dcp_state.h) -- each ZeRO rank its own shard, rank 0 the model, the param groups and
// the step; --state_dtype=8bit state as whole <slot>_codes and <slot>_absmax tensors, with
// --zero=sorted_greedy or off -- and --init_from_dcp starts a run from such a directory,
// PyTorch-written ones too:
//
//   # Python, at any world size:
//   msd, osd = get_state_dict(model, optimizer)
//   dcp.save({"model": msd, "optim": osd, "step": 20}, checkpoint_id="/ckpt/py20")
//   # dtrain: continues at step 20 with PyTorch's model and optimizer state
//   train --init_from_dcp=/ckpt/py20 --steps=40
//
// The model's parameter names are its nn::Sequential's ("0.weight", ..., "6.bias"), which an
// nn.Sequential of the same layers (Linear, GELU, ...) has in Python.
#ifndef DTRAIN_EXAMPLES_TRAIN_DCP_H_
#define DTRAIN_EXAMPLES_TRAIN_DCP_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "examples/train_job.h"

namespace dtrain::examples {

inline constexpr char kDcpDir[] = "dcp";  // in each step directory, --checkpoint_format=dcp

// Collective: this rank's part of the step's model and optimizer state into `dir` (which exists).
// Errors: save_dcp's (the same on every rank).
absl::Status save_train_dcp(const Job& job, Trainer& t, int64_t step, const std::string& dir);

// Not collective: loads the optimizer state (under ZeRO the pieces this rank owns) and, with
// `with_model`, the model from `dir`; returns the checkpoint's "step" (0 when it has none).
// Errors: the reader's (NotFound for a directory without .metadata, DataLoss for damage),
// InvalidArgument for a model that does not match (a missing parameter, another shape); throws
// what the optimizer's load_state_dict throws (the caller guards it).
absl::StatusOr<int64_t> load_train_dcp(Trainer& t, const std::string& dir, bool with_model);

}  // namespace dtrain::examples

#endif  // DTRAIN_EXAMPLES_TRAIN_DCP_H_
