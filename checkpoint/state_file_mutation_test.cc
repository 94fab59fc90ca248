// Property: whatever happens to a state file's bytes -- cut at any offset, any byte's bit flipped,
// a range zeroed or overwritten, bytes appended, a valid zip rebuilt around altered content --
// load_state returns an error or a value equal to the one saved; never a crash, an out-of-bounds
// read (run it under --config=asan) or other data. Three kinds of file: dtrain's (with its checksum
// trailer), the same without its trailer (only the zip's per-entry CRC-32s protect it, as in
// torch.save's files), and files Python's torch.save wrote (protocols 2 and 4).
#include <fstream>
#include <iostream>
#include <random>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "checkpoint/fuzz_support.h"
#include "checkpoint/python_test_files.h"
#include "checkpoint/state_file.h"
#include "checkpoint/stored_zip.h"
#include "checkpoint/test_zip.h"

namespace dtrain::checkpoint {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

enum class Kind { kDtrain, kNoTrailer, kPythonProtocol2, kPythonProtocol4 };

std::string kind_name(Kind k) {
  switch (k) {
    case Kind::kDtrain:
      return "dtrain";
    case Kind::kNoTrailer:
      return "no_trailer";
    case Kind::kPythonProtocol2:
      return "python_protocol2";
    case Kind::kPythonProtocol4:
      return "python_protocol4";
  }
  return "?";
}

class StateFileMutationTest : public ::testing::TestWithParam<Kind> {};

TEST_P(StateFileMutationTest, AnyDamageIsAnErrorOrTheSavedValue) {
  const Kind kind = GetParam();
  const std::string path = testing::test_tmpdir() + "/" + kind_name(kind) + ".pt";
  std::string good;
  if (kind == Kind::kDtrain || kind == Kind::kNoTrailer) {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("w", at::arange(6, at::kFloat).reshape({2, 3}));
    d.insert("v", d.at("w").toTensor().t());
    d.insert("step", int64_t{3});
    d.insert("lr", 0.5);
    d.insert("groups", c10::List<int64_t>({0, 1}));
    ASSERT_TRUE(save_state(path, d).ok());
    good = read_file(path);
    if (kind ==
        Kind::kNoTrailer) {  // drop the trailer and zero the comment length: torch.save's layout
      good.resize(good.rfind("dtrain-state-file"));
      good[good.size() - 2] = 0;
      good[good.size() - 1] = 0;
    }
  } else {
    absl::StatusOr<std::string> dir = testing::python_files_dir();
    ASSERT_TRUE(dir.ok()) << dir.status();
    good = read_file(*dir + (kind == Kind::kPythonProtocol2 ? "/adam_one.pt" : "/protocol4.pt"));
    ASSERT_FALSE(good.empty());
  }
  write_file(path, good);
  const absl::StatusOr<c10::IValue> base = load_state(path);
  ASSERT_TRUE(base.ok()) << base.status();

  int errors = 0, equal = 0, other = 0;
  // `may_differ`: a valid zip rebuilt around altered content without the dtrain trailer is a valid
  // file holding other data; only "no crash, an error or a value" is required of it.
  auto check = [&](const std::string& bytes, const std::string& what, bool may_differ = false) {
    write_file(path, bytes);
    absl::StatusOr<c10::IValue> v = load_state(path);
    if (!v.ok()) {
      ++errors;
      EXPECT_NE(v.status().message().find(path), std::string::npos) << what << ": " << v.status();
      EXPECT_TRUE(v.status().code() == absl::StatusCode::kDataLoss ||
                  v.status().code() == absl::StatusCode::kInvalidArgument)
          << what << ": " << v.status();
      return;
    }
    if (testing::same_values(*v, *base)) {
      ++equal;
    } else {
      ++other;
      EXPECT_TRUE(may_differ) << what << " loaded different data";
    }
  };
  for (size_t cut = 0; cut < good.size(); ++cut)
    check(good.substr(0, cut), "cut at " + std::to_string(cut));
  for (size_t i = 0; i < good.size(); ++i) {
    std::string b = good;
    b[i] = static_cast<char>(b[i] ^ (1 << (i % 8)));
    check(b, "bit " + std::to_string(i % 8) + " of byte " + std::to_string(i));
  }
  std::mt19937 rng(7);
  for (int k = 0; k < 400; ++k) {
    std::string b = good;
    const size_t at = rng() % b.size(), len = 1 + rng() % 64;
    for (size_t i = at; i < std::min(b.size(), at + len); ++i)
      b[i] = k % 2 ? '\0' : static_cast<char>(rng());
    check(b, (k % 2 ? "zeroed " : "random ") + std::to_string(len) + " bytes at " +
                 std::to_string(at));
  }
  for (const std::string& tail :
       {std::string("x"), std::string(100, '\0'), good.substr(good.size() - 40)}) {
    check(good + tail, "appended " + std::to_string(tail.size()) + " bytes");
  }
  // Valid zips with altered content: every bit of the pickle flipped in turn (and every 7th byte of
  // the storages), CRC-32s recomputed, the original comment (dtrain's trailer) kept.
  const absl::StatusOr<StoredZip> zip = read_stored_zip(good, "original");
  ASSERT_TRUE(zip.ok()) << zip.status();
  std::vector<std::pair<std::string, std::string>> entries;
  for (const ZipEntry& e : zip->entries) entries.emplace_back(e.name, std::string(e.data));
  testing::ZipOptions o;
  o.comment = std::string(zip->comment);
  for (size_t n = 0; n < entries.size(); ++n) {
    const bool pickle = entries[n].first.size() > 9 &&
                        entries[n].first.substr(entries[n].first.size() - 9) == "/data.pkl";
    for (size_t i = 0; i < entries[n].second.size(); i += pickle ? 1 : 7) {
      auto altered = entries;
      altered[n].second[i] = static_cast<char>(altered[n].second[i] ^ (1 << (i % 8)));
      check(testing::make_zip(altered, o),
            "rebuilt zip with byte " + std::to_string(i) + " of " + entries[n].first + " altered",
            kind != Kind::kDtrain);
    }
  }
  EXPECT_GT(errors, 0);
  std::cout << kind_name(kind) << " file (" << good.size() << " bytes): " << errors << " errors, "
            << equal << " loads equal to the saved value, " << other
            << " other values from rebuilt valid zips\n";
}

INSTANTIATE_TEST_SUITE_P(AllKinds, StateFileMutationTest,
                         ::testing::Values(Kind::kDtrain, Kind::kNoTrailer, Kind::kPythonProtocol2,
                                           Kind::kPythonProtocol4),
                         [](const ::testing::TestParamInfo<Kind>& info) {
                           return kind_name(info.param);
                         });

}  // namespace
}  // namespace dtrain::checkpoint
