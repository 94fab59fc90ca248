// Property: whatever happens to a state file's bytes -- cut at any offset, any byte's bit flipped,
// a range zeroed or overwritten, bytes appended -- load_state returns an error or a value equal to
// the one saved; never a crash, an out-of-bounds read (run it under --config=asan) or other data.
// Both kinds of file: dtrain's (with its checksum trailer) and one without a trailer, as Python's
// torch.save writes them (only the zip's per-entry CRC-32s protect it).
#include <fstream>
#include <iostream>
#include <random>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "checkpoint/state_file.h"

namespace dtrain::checkpoint {
namespace {

bool same(const c10::IValue& a, const c10::IValue& b) {
  if (a.isTensor() || b.isTensor()) {
    return a.isTensor() && b.isTensor() && a.toTensor().dtype() == b.toTensor().dtype() &&
           a.toTensor().sizes() == b.toTensor().sizes() && a.toTensor().equal(b.toTensor());
  }
  if (a.isGenericDict() || b.isGenericDict()) {
    if (!a.isGenericDict() || !b.isGenericDict()) return false;
    auto x = a.toGenericDict(), y = b.toGenericDict();
    if (x.size() != y.size()) return false;
    for (const auto& kv : x) {
      if (!y.contains(kv.key()) || !same(kv.value(), y.at(kv.key()))) return false;
    }
    return true;
  }
  if (a.isList() || b.isList()) {
    if (!a.isList() || !b.isList() || a.toListRef().size() != b.toListRef().size()) return false;
    for (size_t i = 0; i < a.toListRef().size(); ++i) {
      if (!same(a.toListRef()[i], b.toListRef()[i])) return false;
    }
    return true;
  }
  return a == b;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

class StateFileMutationTest : public ::testing::TestWithParam<bool> {};

TEST_P(StateFileMutationTest, AnyDamageIsAnErrorOrTheSavedValue) {
  const bool with_trailer = GetParam();
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = tmp != nullptr ? tmp : "/tmp";
  const std::string path = dir + (with_trailer ? "/dtrain.pt" : "/python_like.pt");
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("w", at::arange(6, at::kFloat).reshape({2, 3}));
  d.insert("step", int64_t{3});
  d.insert("lr", 0.5);
  ASSERT_TRUE(save_state(path, d).ok());
  std::string good = read_file(path);
  if (!with_trailer) {
    // Drop the trailer and zero the comment length: what torch.save writes.
    const size_t comment = good.rfind("dtrain-state-file");
    ASSERT_NE(comment, std::string::npos);
    good.resize(comment);
    good[good.size() - 2] = 0;
    good[good.size() - 1] = 0;
  }
  write_file(path, good);
  absl::StatusOr<c10::IValue> base = load_state(path);
  ASSERT_TRUE(base.ok()) << base.status();
  ASSERT_TRUE(same(*base, d));

  int errors = 0, equal = 0;
  auto check = [&](const std::string& bytes, const std::string& what) {
    write_file(path, bytes);
    absl::StatusOr<c10::IValue> v = load_state(path);
    if (!v.ok()) {
      ++errors;
      EXPECT_NE(v.status().message().find(path), std::string::npos) << what << ": " << v.status();
      return;
    }
    ++equal;
    EXPECT_TRUE(same(*v, d)) << what << " loaded different data";
  };
  for (size_t cut = 0; cut < good.size(); ++cut) check(good.substr(0, cut), "cut at " + std::to_string(cut));
  for (size_t i = 0; i < good.size(); ++i) {
    std::string b = good;
    b[i] = static_cast<char>(b[i] ^ (1 << (i % 8)));
    check(b, "bit " + std::to_string(i % 8) + " of byte " + std::to_string(i));
  }
  std::mt19937 rng(7);
  for (int k = 0; k < 300; ++k) {
    std::string b = good;
    const size_t at = rng() % b.size(), len = 1 + rng() % 64;
    for (size_t i = at; i < std::min(b.size(), at + len); ++i) b[i] = k % 2 ? '\0' : static_cast<char>(rng());
    check(b, (k % 2 ? "zeroed " : "random ") + std::to_string(len) + " bytes at " + std::to_string(at));
  }
  for (const std::string& tail : {std::string("x"), std::string(100, '\0'), good.substr(good.size() - 40)}) {
    check(good + tail, "appended " + std::to_string(tail.size()) + " bytes");
  }
  EXPECT_GT(errors, 0);
  std::cout << (with_trailer ? "dtrain file: " : "trailer-less file: ") << errors << " errors, " << equal
            << " loads equal to the saved value\n";
}

INSTANTIATE_TEST_SUITE_P(BothKinds, StateFileMutationTest, ::testing::Values(true, false));

}  // namespace
}  // namespace dtrain::checkpoint
