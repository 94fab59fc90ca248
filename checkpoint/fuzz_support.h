// Test-only helpers shared by the checkpoint readers' fuzzers and mutation tests
// (fuzz:torch_file_fuzzer, checkpoint:state_file_mutation_test, examples:
// powersgd_state_mutation_test, the libFuzzer targets in //fuzz): seed files, a walk that reads
// every tensor byte, and a deep comparison of loaded values.
//
//   for (const std::string& file : dtrain::checkpoint::testing::torch_file_seeds()) ...
//   absl::StatusOr<c10::IValue> v = read_torch_file(bytes, "input");
//   if (v.ok()) dtrain::checkpoint::testing::touch_all(*v);   // ASan sees any read past a storage
#ifndef DTRAIN_CHECKPOINT_FUZZ_SUPPORT_H_
#define DTRAIN_CHECKPOINT_FUZZ_SUPPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

namespace dtrain::checkpoint::testing {

// Valid PyTorch files that reach every part of the reader: dtrain's writer (views, half, bool,
// tuples, None), LibTorch's pickle_save (type tags, typed lists), protocol 4 with framing, memo,
// OrderedDict, a Parameter, in a plain and a zip64 archive; plus the files in $DTRAIN_FUZZ_CORPUS.
std::vector<std::string> torch_file_seeds();

// Reads every byte of every tensor in `v` (nested dicts, lists and tuples; bounded depth).
uint64_t touch_all(const c10::IValue& v);

// `zip` with the entry whose name ends in "data.pkl" replaced by `pickle` (CRCs recomputed), so a
// fuzzer's input reaches the unpickler instead of failing the checksum. `zip` unchanged when it has
// no such entry or is not a stored zip.
std::string with_pickle(const std::string& zip, const std::string& pickle);

// The data.pkl entry of a stored zip ("" when there is none).
std::string pickle_of(const std::string& zip);

// Equal values, as mutation tests compare a loaded file with the original: tensors of one dtype,
// shape and strides holding the same numbers, doubles bit for bit, dicts, lists and tuples
// element by element, anything else by IValue's ==.
bool same_values(const c10::IValue& a, const c10::IValue& b);

}  // namespace dtrain::checkpoint::testing

#endif  // DTRAIN_CHECKPOINT_FUZZ_SUPPORT_H_
