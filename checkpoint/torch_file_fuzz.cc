// A mutation fuzzer for read_torch_file and load_state, without libFuzzer: seeds written by dtrain's
// writer and LibTorch's pickle_save (plus any files in $DTRAIN_FUZZ_CORPUS), mutated at the byte
// level (bit flips, interesting values, insertions, deletions, splices, truncation) and at the
// pickle level (opcode fragments inserted into data.pkl, the zip rebuilt with valid CRC-32s so the
// pickle machine is reached). Every input must give an error or a value whose tensors can be read
// in full; a crash or an out-of-bounds read (under --config=asan) is the failure it looks for.
//
//   bazel test //checkpoint:torch_file_fuzz                        # 15 s, seed 1
//   bazel test --config=asan --test_env=DTRAIN_FUZZ_SECONDS=600 --test_env=DTRAIN_FUZZ_SEED=7
//       --test_timeout=900 //checkpoint:torch_file_fuzz
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/fuzz_support.h"
#include "checkpoint/state_file.h"
#include "checkpoint/stored_zip.h"
#include "checkpoint/test_zip.h"
#include "checkpoint/torch_file_reader.h"

namespace dtrain::checkpoint {
namespace {

using Entries = std::vector<std::pair<std::string, std::string>>;
using namespace std::string_literals;

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoll(v) : fallback;
}

const std::vector<std::string> kFragments = {"\0"s,
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

std::string mutate_bytes(std::string b, const std::vector<std::string>& all, std::mt19937_64& rng) {
  auto pos = [&](size_t size) { return size == 0 ? 0 : rng() % (size + 1); };
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int r = 0; r < rounds; ++r) {
    switch (rng() % 9) {
      case 0:
        if (!b.empty()) b[rng() % b.size()] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1: {
        static const char kInteresting[] = {'\0', '\x01', '\x7f', '\x80', '\xff', 'P', 'K'};
        if (!b.empty()) b[rng() % b.size()] = kInteresting[rng() % sizeof(kInteresting)];
        break;
      }
      case 2:
        b.resize(pos(b.size()));
        break;
      case 3: {
        const size_t at = pos(b.size());
        b.erase(at, rng() % 64);
        break;
      }
      case 4:
        b.insert(pos(b.size()), kFragments[rng() % kFragments.size()]);
        break;
      case 5: {  // splice a piece of another seed
        const std::string& other = all[rng() % all.size()];
        const size_t from = rng() % other.size();
        b.insert(pos(b.size()), other.substr(from, rng() % 128));
        break;
      }
      case 6:
        b.append(rng() % 32, static_cast<char>(rng()));
        break;
      case 7:
        if (b.size() >= 4) {  // a 32-bit field set to an extreme
          const size_t at = rng() % (b.size() - 3);
          const uint32_t v = rng() % 2 ? 0xffffffffu : static_cast<uint32_t>(rng() % 1024);
          for (int i = 0; i < 4; ++i)
            b[at + static_cast<size_t>(i)] = static_cast<char>(v >> (8 * i));
        }
        break;
      default: {
        if (b.empty()) break;
        const size_t at = rng() % b.size(), len = rng() % 16;
        b.insert(at, b.substr(at, len));
        break;
      }
    }
  }
  return b;
}

// Mutates one entry's data (the pickle, mostly) and rebuilds a valid zip around it.
std::string mutate_content(const std::string& seed, const std::vector<std::string>& all,
                           std::mt19937_64& rng) {
  const absl::StatusOr<StoredZip> zip = read_stored_zip(seed, "seed");
  if (!zip.ok() || zip->entries.empty()) return mutate_bytes(seed, all, rng);
  Entries e;
  for (const ZipEntry& x : zip->entries) e.emplace_back(x.name, std::string(x.data));
  size_t n = rng() % e.size();
  for (size_t i = 0; i < e.size() && rng() % 4 != 0; ++i) {
    if (e[i].first.size() > 8 && e[i].first.substr(e[i].first.size() - 8) == "data.pkl") n = i;
  }
  e[n].second = mutate_bytes(e[n].second, all, rng);
  testing::ZipOptions o;
  o.zip64 = rng() % 8 == 0;
  return testing::make_zip(e, o);
}

TEST(TorchFileFuzz, MutatedFilesGiveErrorsOrReadableValues) {
  const int64_t seconds = env_int("DTRAIN_FUZZ_SECONDS", 15);
  const auto seed = static_cast<uint64_t>(env_int("DTRAIN_FUZZ_SEED", 1));
  const std::vector<std::string> corpus = testing::torch_file_seeds();
  for (const std::string& s : corpus)
    ASSERT_TRUE(read_torch_file(s, "seed").ok()) << read_torch_file(s, "seed").status();
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/fuzz_", ::getpid(), ".pt");
  std::mt19937_64 rng(seed);
  std::map<std::string, int64_t> outcomes;
  int64_t runs = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (std::chrono::steady_clock::now() < end) {
    for (int batch = 0; batch < 64; ++batch, ++runs) {
      const std::string& base = corpus[rng() % corpus.size()];
      const std::string input =
          rng() % 2 ? mutate_content(base, corpus, rng) : mutate_bytes(base, corpus, rng);
      absl::StatusOr<c10::IValue> v = read_torch_file(input, "fuzz input");
      if (v.ok()) {
        testing::touch_all(*v);
        ++outcomes["ok"];
      } else {
        ++outcomes[absl::StatusCodeToString(v.status().code())];
        EXPECT_NE(v.status().message().find("fuzz input"), std::string::npos) << v.status();
      }
      if (runs % 16 == 0) {  // through load_state too, the trailer logic included
        std::ofstream(path, std::ios::binary | std::ios::trunc) << input;
        absl::StatusOr<c10::IValue> s = load_state(path);
        if (s.ok()) testing::touch_all(*s);
      }
    }
  }
  std::cout << "seed " << seed << ", " << runs << " inputs in " << seconds << " s:";
  for (const auto& [k, n] : outcomes) std::cout << " " << k << "=" << n;
  std::cout << "\n";
  EXPECT_GT(outcomes["ok"],
            0);  // the mutations are not all fatal: the reader's insides are reached
}

}  // namespace
}  // namespace dtrain::checkpoint
