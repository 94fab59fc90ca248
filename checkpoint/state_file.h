// State files: one c10::IValue (a dict of model state, optimizer state, step, world size...) per
// file, in the zip format Python's torch.load reads with stock PyTorch. Writes are atomic
// (temporary file in the same directory, fsync, rename, fsync of the directory): a crash leaves the
// old file or the new one, never a torn one. A CRC-32 of the contents is kept in the zip comment
// and verified at load, so a truncated or corrupted file is an error naming it, never a crash or
// a silently wrong tensor.
//
//   c10::impl::GenericDict ckpt(c10::StringType::get(), c10::AnyType::get());
//   ckpt.insert("optimizer", optimizer.state_dict());
//   ckpt.insert("step", int64_t{1000});
//   absl::Status s = dtrain::checkpoint::save_state("/ckpt/step1000.pt", ckpt);
//   absl::StatusOr<c10::IValue> back = dtrain::checkpoint::load_state("/ckpt/step1000.pt");
//   // Python: torch.load("/ckpt/step1000.pt") -> {'optimizer': {...}, 'step': 1000}
#ifndef DTRAIN_CHECKPOINT_STATE_FILE_H_
#define DTRAIN_CHECKPOINT_STATE_FILE_H_

#include <cstdint>
#include <functional>
#include <string>

#include <ATen/core/ivalue.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dtrain::checkpoint {

struct SaveOptions {
  // Bytes per write() call.
  int64_t write_chunk_bytes = int64_t{8} << 20;
  // Testing hook: called after each chunk is written to the temporary file (bytes so far).
  std::function<void(int64_t)> after_chunk;
};

// Serialises `state` (tensors, dicts, lists, strings, numbers, None) and replaces `path`
// atomically. Errors: Internal (cannot serialise), Unavailable/PermissionDenied/NotFound (I/O:
// the message names the path and the OS error).
absl::Status save_state(const std::string& path, const c10::IValue& state, const SaveOptions& options = {});

// Reads a file written by save_state, verifying its size and checksum first. Errors: NotFound
// (no such file), DataLoss (truncated or corrupted: names the file and what is wrong),
// InvalidArgument (not a dtrain state file and not readable by LibTorch either).
// Files written by Python's torch.save carry no checksum; LibTorch 1.13 reads some of them.
absl::StatusOr<c10::IValue> load_state(const std::string& path);

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_STATE_FILE_H_
