// Fuzz target: checkpoint's reader of PyTorch files (read_torch_file: the stored zip, the pickle
// machine, storages and views) and load_state (the checksum trailer). The first input byte picks
// what the rest is: even, a whole file; odd, a pickle put into a seed archive as its data.pkl with
// valid CRCs, so mutations reach the unpickler instead of stopping at a checksum. Every input must
// give an error or a value whose tensors can be read in full; neither function may throw; an error
// names the input. Its dictionary (pickle opcodes with extreme arguments, the globals PyTorch's
// files name and some they must not) lets the mutation driver write pickle-level edits.
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/fuzz_support.h"
#include "checkpoint/state_file.h"
#include "checkpoint/torch_file_reader.h"
#include "fuzz/fuzz_target.h"

namespace {

using namespace std::string_literals;

const std::vector<std::string> kPickleTokens = {"\0"s,
                                                "(",
                                                "t",
                                                "R",
                                                "b",
                                                "\x94",
                                                "\x93",
                                                "0",
                                                "1",
                                                "2",
                                                "e",
                                                "u",
                                                "s",
                                                "a",
                                                "\x85",
                                                "\x86",
                                                "\x87",
                                                "}",
                                                "]",
                                                ")",
                                                "N",
                                                ".",
                                                "Q",
                                                "\x81",
                                                "h\x00"s,
                                                "h\x01",
                                                "q\x00"s,
                                                "q\xff",
                                                "j\xff\xff\xff\x7f",
                                                "J\xff\xff\xff\xff",
                                                "X\xff\xff\xff\x7f",
                                                "\x8c\xff",
                                                "\x8a\x09",
                                                "\x8b\xff\xff\xff\xff",
                                                "\x95\xff\xff\xff\xff\xff\xff\xff\xff",
                                                "K\x00"s,
                                                "K\xff",
                                                "M\xff\xff",
                                                "G\x7f\xf8\0\0\0\0\0\0"s,
                                                "\x88",
                                                "\x89",
                                                "ccollections\nOrderedDict\n",
                                                "ctorch._utils\n_rebuild_tensor_v2\n",
                                                "ctorch\nFloatStorage\n",
                                                "ctorch\nBoolStorage\n",
                                                "ctorch.jit._pickle\nrestore_type_tag\n",
                                                "ctorch.jit._pickle\nbuild_intlist\n",
                                                "ctorch\nSize\n",
                                                "ctorch\ndevice\n",
                                                "c_codecs\nencode\n",
                                                "cos\nsystem\n",
                                                "\x8f",
                                                "\x90"};

const std::vector<std::string>& archives() {
  static const std::vector<std::string> kArchives = dtrain::checkpoint::testing::torch_file_seeds();
  return kArchives;
}

}  // namespace

namespace dtrain::fuzz {

std::vector<std::string> seeds() {
  std::vector<std::string> out;
  for (size_t i = 0; i < archives().size(); ++i) {
    out.push_back(std::string(1, static_cast<char>(2 * i)) + archives()[i]);
    const std::string pickle = checkpoint::testing::pickle_of(archives()[i]);
    if (!pickle.empty()) out.push_back(std::string(1, static_cast<char>(2 * i + 1)) + pickle);
  }
  return out;
}

std::vector<std::string> dictionary() { return kPickleTokens; }

}  // namespace dtrain::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace ck = dtrain::checkpoint;
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  const std::string file =
      data[0] % 2 == 0
          ? rest
          : ck::testing::with_pickle(archives()[(data[0] / 2) % archives().size()], rest);
  try {
    absl::StatusOr<c10::IValue> v = ck::read_torch_file(file, "fuzz input");
    if (v.ok()) ck::testing::touch_all(*v);
    DTRAIN_FUZZ_CHECK(
        v.ok() || v.status().message().find("fuzz input") != std::string::npos,
        absl::StrCat("an error that does not name the input: ", v.status().ToString()));
    static const std::string path =
        absl::StrCat(std::getenv("TEST_TMPDIR") != nullptr ? std::getenv("TEST_TMPDIR") : "/tmp",
                     "/dtrain_fuzz_", ::getpid(), ".pt");
    std::ofstream(path, std::ios::binary | std::ios::trunc) << file;
    absl::StatusOr<c10::IValue> s = ck::load_state(path);
    if (s.ok()) ck::testing::touch_all(*s);
  } catch (const std::exception& e) {
    DTRAIN_FUZZ_CHECK(false,
                      absl::StrCat("the reader threw instead of returning a Status: ", e.what()));
  }
  return 0;
}
