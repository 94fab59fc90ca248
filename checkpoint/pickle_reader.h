// A Python pickle reader for the data.pkl inside PyTorch files, owned by dtrain: no LibTorch
// unpickler, and no code from the file is ever run. It executes the opcodes Python 3's pickler
// (protocols 2-5, and the text forms of protocol 0 numbers) and LibTorch's Pickler emit for plain
// state dicts; a global is only resolved against a short allow-list (OrderedDict, torch's tensor,
// parameter and storage rebuilders, torch.Size, torch.device, LibTorch's type tags and typed-list
// builders, _codecs.encode), like torch.load(weights_only=True). Every read is bounds-checked,
// length fields are checked against the bytes left before anything is allocated, memo indices and
// stack/mark underflows are checked, nesting is capped (1000 levels), reference cycles are refused.
//
//   absl::StatusOr<c10::IValue> v = dtrain::checkpoint::read_pickle(
//       pkl_bytes, "state file a.pt",
//       [&](const std::string& key, at::ScalarType dtype, int64_t numel) -> absl::StatusOr<at::Storage> {
//         return storage_from_archive_entry(key, dtype, numel);  // e.g. torch_file_reader.cc
//       });
//   if (!v.ok()) return v.status();
//
// Values come back as LibTorch's own unpickler makes them: dicts (and OrderedDicts, in insertion
// order) as c10::impl::GenericDict(Any, Any), lists as c10::impl::GenericList(Any) -- unless
// LibTorch's restore_type_tag retypes them (Dict[str, Tensor], List[int], ...), build_intlist and
// friends make c10::List<int64_t>/<double>/<bool>/<at::Tensor> --, tuples as ivalue::Tuple, int as
// int64, float as double, bool, None, str (bytes too, as a str of raw bytes), torch.Size as a tuple,
// torch.device as c10::Device, tensors as CPU tensors over the storages the loader returns (views
// of one storage share it; requires_grad kept). Dict keys may be str, int, float, bool or tensors.
#ifndef DTRAIN_CHECKPOINT_PICKLE_READER_H_
#define DTRAIN_CHECKPOINT_PICKLE_READER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"

namespace dtrain::checkpoint {

// What a pickle may hold beyond plain values.
enum class PickleDialect {
  // A state dict (the allow-list above): torch.load(weights_only=True)'s values.
  kStateDict,
  // torch.distributed.checkpoint's .metadata (checkpoint/dcp_metadata.h reads it): plain values
  // plus exactly DCP's own dataclasses -- Metadata, TensorStorageMetadata, BytesStorageMetadata,
  // ChunkStorageMetadata, TensorProperties, MetadataIndex, StorageMeta (module
  // torch.distributed.checkpoint.metadata) and _StorageInfo (....filesystem) -- created by NEWOBJ
  // with no arguments, the values their BUILD state holds (torch.<dtype> as the str
  // "torch.float32", torch.serialization._get_layout(str) as that str, _MEM_FORMAT_ENCODING(int)
  // as that int, pathlib's (and Python 3.13's pathlib._local's) PosixPath/PurePosixPath/
  // WindowsPath(parts...) as the str of the parts joined by '/'), and torch.Size. No storages.
  // An object comes back as a dict {"__class__": "<ClassName>", <its fields>...}: a dict state
  // is merged into it, a slots state (None or a dict, dict) too, any other state
  // (TensorProperties' 5-tuple, 6 since PyTorch 2.15) is its "__state__". A
  // MetadataIndex used as a dict key becomes the str "\x01MetadataIndex\x01<offsets>\x01<fqn>",
  // <offsets> "None" or the ints joined by ',' -- Python's own key equality (its index is not
  // compared): a second key equal to one already present is DataLoss.
  kDcpMetadata,
};

// Returns the storage persistent id ('storage', torch.<Dtype>Storage, key, location, numel)
// refers to: REQUIRED to hold at least numel * itemsize(dtype) bytes on the CPU, not aliasing
// anything the caller frees. Called once per key. Its errors are returned as they are.
using StorageLoader = std::function<absl::StatusOr<at::Storage>(
    const std::string& key, at::ScalarType dtype, int64_t numel)>;

// Reads one pickled value. `name_for_errors` is how messages refer to the file ("state file
// /ckpt/a.pt"); messages also give the byte offset inside the pickle. Errors: InvalidArgument for
// well-formed content dtrain does not read (a global outside the allow-list: the message names
// it; sets, objects, protocol 0 strings, a protocol newer than 5, a tensor rebuilt with
// requires_grad on an integer dtype, an unhashable dict key); DataLoss for malformed bytes (an
// invalid opcode, a truncated argument, a stack or mark underflow, a memo index never stored,
// a tensor extending past its storage, invalid UTF-8, nesting deeper than 1000, a cycle).
// Thread safety: a pure function of its arguments (plus the loader's own behaviour).
absl::StatusOr<c10::IValue> read_pickle(std::string_view pickle, const std::string& name_for_errors,
                                        const StorageLoader& load_storage,
                                        PickleDialect dialect = PickleDialect::kStateDict);

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_PICKLE_READER_H_
