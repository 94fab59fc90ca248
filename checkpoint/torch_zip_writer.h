// Writes a value in PyTorch's own file format, exactly as Python's `torch.save` does for plain
// state dicts, so that `torch.load(path)` reads it with its default `weights_only=True` (PyTorch
// 2.6 and later refuse the `torch.jit._pickle.restore_type_tag` globals that LibTorch's own
// pickler adds to every dict and list) and PyTorch 1.13's `torch.load` reads it too.
//
//   absl::StatusOr<std::string> bytes = dtrain::checkpoint::write_torch_zip(state_dict);
//   // Python: torch.load(io.BytesIO(bytes)) == the same dict, tensors bit-identical
//
// The file is a zip of stored (uncompressed) entries: archive/data.pkl (pickle protocol 2: dicts,
// lists, tuples, str, int, float, bool, None, and tensors through torch._utils._rebuild_tensor_v2
// with one persistent id per storage), archive/byteorder ("little"), archive/data/<key> (one per
// storage, 64-byte aligned as PyTorch writes them, so Python can mmap), archive/version. Views of
// one storage share it in the file and after loading. Containers come back from LibTorch's or
// dtrain's reader as Dict[Any, Any] / List[Any], as from any Python-written file.
//
// The zip ends with a 22-byte end-of-central-directory record whose comment length is 0, so a
// caller may set the comment length and append a comment (checkpoint/state_file.cc's trailer).
#ifndef DTRAIN_CHECKPOINT_TORCH_ZIP_WRITER_H_
#define DTRAIN_CHECKPOINT_TORCH_ZIP_WRITER_H_

#include <string>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"

namespace dtrain::checkpoint {

// The complete bytes of a PyTorch-format file holding `value`. Errors: InvalidArgument naming
// the path inside `value` (e.g. "state/3/exp_avg") of something Python's weights-only loader
// would not take: objects, futures, non-CPU, sparse or quantized tensors, dtypes without a
// storage class; OutOfRange for a file of 4 GiB or more (zip64 is not written yet).
absl::StatusOr<std::string> write_torch_zip(const c10::IValue& value);

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_TORCH_ZIP_WRITER_H_
