// State files: one c10::IValue (a dict of model state, optimizer state, step, world size...) per
// file, in PyTorch's own file format, which Python's torch.load reads (weights_only=True included).
// Writes are atomic (temporary file in the same directory, fsync, rename, fsync of the directory):
// a crash leaves the old file or the new one, never a torn one. A CRC-32 of the whole file is kept
// in a trailer (the zip comment) and verified at load.
//
//   c10::impl::GenericDict ckpt(c10::StringType::get(), c10::AnyType::get());
//   ckpt.insert("optimizer", optimizer.state_dict());
//   ckpt.insert("step", int64_t{1000});
//   absl::Status s = dtrain::checkpoint::save_state("/ckpt/step1000.pt", ckpt);
//   absl::StatusOr<c10::IValue> back = dtrain::checkpoint::load_state("/ckpt/step1000.pt");
//   // Python: torch.load("/ckpt/step1000.pt") -> {'optimizer': {...}, 'step': 1000}
//   dtrain::checkpoint::LoadOptions on_gpu;                 // torch.load(..., map_location=...)
//   on_gpu.map_location = c10::Device(c10::kCUDA, local_rank);
//   back = dtrain::checkpoint::load_state("/ckpt/step1000.pt", on_gpu);
//
// load_state reads, with dtrain's own reader (checkpoint/torch_file_reader.h; never LibTorch's
// unpickler, never code from the file):
//   - files save_state wrote: the zip's end record must end the file and its comment must be the
//     trailer "dtrain-state-file v1 crc32=<8 hex> size=<bytes before the comment>", whose size and
//     whole-file CRC-32 must verify; a file cut inside the trailer, with bytes appended after it, or
//     with any byte of the trailer damaged is DataLoss, never loaded unverified;
//   - files Python's torch.save (PyTorch 1.6 and later, 1.13 and 2.x) or LibTorch's pickle_save
//     wrote, which have no zip comment: the zip's per-entry CRC-32s are verified before anything
//     is unpickled; plain state dicts are read (tensors of the standard dtypes, Parameters as
//     tensors, numbers, str, bool, None, dicts/OrderedDicts, lists, tuples), as
//     torch.load(weights_only=True) reads them; tensors saved from a GPU (location 'cuda:0')
//     included, which come back on the CPU unless LoadOptions::map_location says otherwise.
// It refuses (InvalidArgument, naming the file and what to do): the legacy pre-1.6 format,
// TorchScript archives, compressed entries, big-endian files, and any pickle that names a Python
// global outside a short allow-list (objects, functions: the message names the global).
#ifndef DTRAIN_CHECKPOINT_STATE_FILE_H_
#define DTRAIN_CHECKPOINT_STATE_FILE_H_

#include <cstdint>
#include <functional>
#include <string>

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dtrain::checkpoint {

struct SaveOptions {
  // Bytes per write() call.
  int64_t write_chunk_bytes = int64_t{8} << 20;
  // Testing hook: called after each chunk is written to the temporary file (bytes so far).
  std::function<void(int64_t)> after_chunk;
};

struct LoadOptions {
  // PyTorch's torch.load(map_location=...): the device every tensor loaded is put on, e.g.
  // c10::Device(c10::kCUDA, local_rank), whatever location the file records ('cpu' in files
  // save_state writes, 'cuda:0' in files torch.save wrote from a GPU). Tensors that shared a
  // storage share one there too. Default the CPU: tensors are views into the file's bytes, read
  // once, with no further copy.
  c10::Device map_location = c10::Device(c10::kCPU);
};

// Serialises `state` (tensors, dicts, lists, strings, numbers, None) and replaces `path`
// atomically. Tensors may live on a GPU: they are copied to the CPU storage by storage and the
// file records them as on the CPU (checkpoint/torch_file_writer.h), so it loads anywhere.
// Errors: Internal (cannot serialise), Unavailable/PermissionDenied/NotFound (I/O: the message
// names the path and the OS error).
absl::Status save_state(const std::string& path, const c10::IValue& state,
                        const SaveOptions& options = {});

// Reads a file written by save_state or by PyTorch's torch.save (see above), every byte verified
// by a checksum before it is decoded. Dicts and lists come back typed where their contents say
// so (a non-empty c10::List<at::Tensor> saved comes back as one, a Dict[str, Tensor] likewise:
// checkpoint/container_types.h), Any where mixed or empty; tensors on options.map_location (the
// CPU by default). Errors: NotFound (no such file), PermissionDenied/Unavailable (I/O), DataLoss
// (truncated, bytes appended, corrupted, a damaged trailer: names the file and what is wrong),
// InvalidArgument (a file dtrain does not read: the list above; a map_location this process
// cannot use), ResourceExhausted (no memory for the file, or on map_location for its tensors).
// Never a crash on any bytes. Thread safety: safe to call concurrently.
absl::StatusOr<c10::IValue> load_state(const std::string& path, const LoadOptions& options = {});

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_STATE_FILE_H_
