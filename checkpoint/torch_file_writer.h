// Writes a c10::IValue as the bytes of a PyTorch file exactly as Python's `torch.save` writes a
// plain state dict, so that Python's `torch.load(path)` reads it with its default
// `weights_only=True` (PyTorch 2.6 refuses the `torch.jit._pickle.*` globals LibTorch's own
// `torch::jit::pickle_save` emits), PyTorch 1.13's `torch.load` reads it, and LibTorch's
// `torch::jit::pickle_load` reads it back.
//
//   c10::impl::GenericDict sd(c10::StringType::get(), c10::AnyType::get());
//   sd.insert("weight", at::ones({2, 3}));
//   sd.insert("step", int64_t{1000});
//   absl::StatusOr<std::string> bytes = dtrain::checkpoint::write_torch_file(sd);
//   if (!bytes.ok()) return bytes.status();   // InvalidArgument names the offending path
//   // write *bytes to "ckpt.pt"; Python: torch.load("ckpt.pt") == {'weight': ..., 'step': 1000}
//
// The file is a zip of stored (uncompressed) entries, in torch.save's order:
//   <archive>/data.pkl      pickle protocol 2, opcode for opcode what CPython's pickler writes for
//                           torch.save (memo and batches of 1000 included): dicts in insertion
//                           order, lists, tuples, str, int, float, bool, None; tensors through
//                           torch._utils._rebuild_tensor_v2 with one persistent id per storage.
//                           Three spellings differ, the values read being the same, because
//                           LibTorch's unpickler (1.13's, which dtrain reads with) knows only them:
//                           a one-item dict or list is MARK K V SETITEMS / MARK X APPENDS (CPython:
//                           SETITEM / APPEND), an int beyond 32 bits is an 8-byte LONG1 (CPython:
//                           as few bytes as it needs);
//   <archive>/byteorder     "little";
//   <archive>/data/<key>    one per storage ("0", "1", ... in first-use order), the storage's
//                           whole bytes, starting at a multiple of 64 bytes (padding in the local
//                           header's "FB" extra field, as PyTorch's writer does, so Python can mmap);
//   <archive>/version       "3\n" (what both PyTorch 1.13 and 2.6 write and read);
//   <archive>/.data/serialization_id   only when TorchFileWriteOptions::serialization_id is set.
// Zip64 fields and records are written where a size, an offset or the entry count needs them
// (entries or files of 4 GiB or more, 65535 entries or more, i.e. about 65531 storages): every
// 32-bit field is either exact or 0xFFFFFFFF with the zip64 value present, never truncated.
// Checked: a 4 GiB + 100 byte tensor, and 65540 storages, load in Python 1.13 and 2.6 and LibTorch.
//
// The zip ends with its 22-byte end-of-central-directory record, comment length 0, as the last 22
// bytes: a caller may set the comment length (the last two bytes, little-endian) and append that
// many bytes of comment (checkpoint/state_file.cc appends its checksum trailer this way); zip
// readers, Python's and LibTorch's included, still find the record.
//
// Python's view of what is written: views of one storage share it after loading (one persistent
// id per storage, dedup by StorageImpl), a tensor or container reachable twice is one object
// (memo), an undefined tensor is None. Float scalars keep their exact bits (NaN, inf, -0.0).
// Note: PyTorch 1.13's *weights-only* unpickler has no BINFLOAT, so 1.13 can read a file with
// float scalars (lr, betas) only with its default weights_only=False; this holds for files
// Python 1.13's own torch.save writes too. 2.x reads everything with weights_only=True.
//
// Tensors on a GPU (any device with data): each storage is copied to the CPU whole, once, however
// many views of it are written (so they still share one storage in the file), with a synchronous
// copy on the current stream -- work queued on other streams must be waited for by the caller.
// The file records every storage's location as 'cpu', where torch.save records 'cuda:0': the file
// loads on any machine, without a GPU and without map_location, and comes back on the CPU (Python:
// torch.load(path, map_location="cuda") puts it back on a GPU; dtrain: LoadOptions::map_location
// in checkpoint/state_file.h). The bytes are those the same tensors on the CPU would give.
#ifndef DTRAIN_CHECKPOINT_TORCH_FILE_WRITER_H_
#define DTRAIN_CHECKPOINT_TORCH_FILE_WRITER_H_

#include <string>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"

namespace dtrain::checkpoint {

struct TorchFileWriteOptions {
  // Folder every entry lives in ("archive/data.pkl"). torch.save uses "archive" for file objects
  // and the file's stem for paths; readers take whatever the first entry says. Non-empty, no '/',
  // no '\\', printable ASCII. Default "archive".
  std::string archive_name = "archive";
  // Contents of <archive>/.data/serialization_id, as PyTorch 2.x writes (a 40-digit string there);
  // no readers need it. Default empty: the entry is not written.
  std::string serialization_id;
  // Testing hook: write zip64 fields and records for every entry even when they fit 32 bits
  // (valid zip, what a file of 4 GiB or more gets), to check readers without 4 GiB of memory.
  // Default false.
  bool force_zip64 = false;
};

// The complete bytes of a PyTorch-format file holding `value`. Accepted: dicts (any key type,
// insertion order kept), lists (generic and specialised int/double/bool/str/tensor lists),
// tuples, str (valid UTF-8), int, double, bool, None, and tensors that are dense (strided), on the
// CPU or a GPU (see above), non-quantized, without conj/neg bits or names, of dtype float32/64,
// float16, bfloat16, int64/32/16/8, uint8, bool or complex64/128.
// An undefined tensor is written as None.
// Errors: InvalidArgument naming the path inside `value` ("state/3/exp_avg"; "(root)" for the
// value itself) and what is wrong, for anything else: objects, futures, devices, complex scalars,
// meta tensors (no data), a device storage that cannot be copied to the CPU, sparse, quantized or
// nested tensors, invalid UTF-8, two tensors viewing one storage as different dtypes
// (torch.save refuses that too), a storage that is not a whole number of elements, dict keys
// that are one key in Python (1, 1.0 and True), nesting deeper than 200 levels, a tuple that
// contains itself; InvalidArgument for a bad archive_name.
// Memory: the result holds every storage's bytes once more (the caller's copy plus the file); a
// GPU storage is held in host memory twice during the call (its CPU copy and the file).
// Thread safety: reads `value` only; safe to call concurrently as long as nobody mutates it.
absl::StatusOr<std::string> write_torch_file(const c10::IValue& value,
                                             const TorchFileWriteOptions& options = {});

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_TORCH_FILE_WRITER_H_
