// Reads PyTorch's own file format -- what Python's `torch.save` (1.6 and later, PyTorch 1.13 and
// 2.x) and LibTorch's `torch::jit::pickle_save` write -- into a c10::IValue, with code owned by
// dtrain: no LibTorch unpickler or zip reader is involved, nothing in the file is ever executed,
// and damaged or hostile bytes give an error, never a crash or an out-of-bounds read.
//
//   absl::StatusOr<c10::IValue> sd = dtrain::checkpoint::read_torch_file(bytes, "file adam.pt");
//   if (!sd.ok()) return sd.status();   // names "file adam.pt" and what is wrong
//   c10::impl::GenericDict d = sd->toGenericDict();   // {'state': {0: {...}}, 'param_groups': [...]}
//
// What is read:
//   - the zip container (checkpoint/stored_zip.h): its end record must end the bytes exactly, every
//     entry must be stored (uncompressed), every entry's CRC-32 is verified BEFORE anything is
//     unpickled (unless the caller verified a whole-file checksum: TorchFileReadOptions);
//   - entries <prefix>/data.pkl (the pickle), <prefix>/data/<key> (storages), <prefix>/byteorder
//     (optional; must be "little"); the prefix is whatever precedes "/data.pkl" (torch.save uses the
//     file's stem, LibTorch "archive"); <prefix>/version and PyTorch 2.x's .data/serialization_id,
//     .format_version and .storage_alignment are not needed and ignored;
//   - the pickle (checkpoint/pickle_reader.h): plain state dicts -- tensors of the 12 standard
//     dtypes, Parameters (as tensors), int, float, bool, None, str, dicts and OrderedDicts, lists,
//     tuples, torch.Size, torch.device -- like torch.load(weights_only=True). Tensors are copied
//     out of `bytes` into fresh CPU tensors whatever device they were saved from: a storage's
//     location ('cpu', 'cuda:0', 'mps', ...: torch.save writes the device it was on) is read and
//     not used, so files saved from a GPU load without one; tensors that shared a storage in
//     Python share one here; requires_grad is kept (TorchFileReadOptions::owner: views into
//     `bytes` instead of copies; TorchFileReadOptions::map_location: onto another device).
// Values come back as LibTorch's own unpickler makes them: dicts as c10::impl::GenericDict(Any,
// Any), lists as c10::impl::GenericList(Any), unless LibTorch's type tags retype them.
//
// What is refused: the legacy (pre-1.6, non-zip) torch.save format and TorchScript archives
// (torch.jit.save), compressed or encrypted entries, big-endian files, globals outside the
// allow-list (objects, functions: the error names the global), sets.
#ifndef DTRAIN_CHECKPOINT_TORCH_FILE_READER_H_
#define DTRAIN_CHECKPOINT_TORCH_FILE_READER_H_

#include <memory>
#include <string>
#include <string_view>

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"

namespace dtrain::checkpoint {

struct TorchFileReadOptions {
  // Verify each zip entry's CRC-32 before unpickling. Turn off only when the caller has verified
  // a checksum over all of `bytes` (checkpoint/state_file.cc's trailer). Default true.
  bool verify_entry_crcs = true;
  // When set, `bytes` stay valid as long as `owner` lives, and tensors are views into them (kept
  // alive by a reference to `owner`) instead of copies: no second copy of a large file in memory.
  // Storages that are not aligned to their element size are still copied. Default: copies.
  std::shared_ptr<const void> owner;
  // PyTorch's torch.load(map_location=device): every tensor read is moved there, storage by
  // storage (views that shared a storage share its copy; requires_grad kept), whatever location
  // the file records. Default the CPU: nothing is moved. A device this process cannot use (no
  // such GPU) is InvalidArgument, running out of its memory ResourceExhausted.
  c10::Device map_location = c10::Device(c10::kCPU);
};

// Reads the value PyTorch stored in `bytes` (a whole file's contents). `name_for_errors` is how
// messages refer to the bytes, e.g. "state file /ckpt/a.pt". The result shares no memory with
// `bytes` (unless options.owner is set and map_location is the CPU: then tensors view `bytes`).
// Errors: DataLoss for damaged or malformed bytes (truncation, bytes appended, a CRC mismatch,
// overlapping entries, an offset or length out of range, a malformed pickle, a tensor outside its
// storage); InvalidArgument for well-formed content dtrain does not read (the list above) and for
// a map_location this process cannot use; ResourceExhausted when map_location runs out of memory;
// each message names the file, says what is wrong and what to do. Thread safety: a pure function
// of its arguments.
absl::StatusOr<c10::IValue> read_torch_file(std::string_view bytes,
                                            const std::string& name_for_errors,
                                            const TorchFileReadOptions& options = {});

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_TORCH_FILE_READER_H_
