#include "checkpoint/state_file.h"

#include <sys/stat.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/container_types.h"
#include "checkpoint/python_test_files.h"

namespace dtrain::checkpoint {
namespace {

using ::testing::HasSubstr;
using Dict = c10::impl::GenericDict;

std::string temp_dir() {
  char dir[] = "/tmp/dtrain_state_file_XXXXXX";
  EXPECT_NE(::mkdtemp(dir), nullptr);
  return dir;
}

Dict sample() {
  Dict d(c10::StringType::get(), c10::AnyType::get());
  Dict optimizer(c10::StringType::get(), c10::AnyType::get());
  Dict state(c10::IntType::get(), c10::AnyType::get());
  for (int64_t i = 0; i < 3; ++i) {
    Dict e(c10::StringType::get(), c10::AnyType::get());
    e.insert("step", at::scalar_tensor(static_cast<double>(i + 1), at::kFloat));
    e.insert("exp_avg", at::arange(10 * (i + 1), at::kFloat).mul(0.37).reshape({i + 1, 10}));
    e.insert("exp_avg_sq", at::arange(7, at::kDouble).pow(1.5));
    state.insert(i, e);
  }
  optimizer.insert("state", state);
  c10::impl::GenericList groups(c10::AnyType::get());
  Dict g(c10::StringType::get(), c10::AnyType::get());
  g.insert("lr", 0.5);
  g.insert("params", c10::List<int64_t>({0, 1, 2}));
  groups.push_back(g);
  optimizer.insert("param_groups", groups);
  d.insert("optimizer", optimizer);
  d.insert("model", Dict(c10::StringType::get(), c10::AnyType::get()));
  d.at("model").toGenericDict().insert("weight", at::arange(12, at::kLong).reshape({3, 4}));
  d.at("model").toGenericDict().insert("mask", at::arange(5).gt(2));
  d.insert("step", int64_t{1000});
  d.insert("world_size", int64_t{2});
  d.insert("note", std::string("dtrain"));
  d.insert("nothing", c10::IValue());
  return d;
}

std::vector<std::string> digest(const c10::IValue& v) { return testing::digest(v); }

// Every kind of value save_state takes: every dtype, views sharing a storage, non-contiguous and
// offset views, empty and 0-d tensors, requires_grad, nested dicts (str, int, float, bool keys),
// lists (generic and typed), tuples, str, int, float (NaN, -0.0), bool, None.
Dict every_kind_of_value() {
  Dict d(c10::StringType::get(), c10::AnyType::get());
  Dict tensors(c10::StringType::get(), c10::AnyType::get());
  for (at::ScalarType t :
       {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt, at::kShort,
        at::kChar, at::kByte, at::kBool, at::kComplexFloat, at::kComplexDouble}) {
    tensors.insert(c10::toString(t),
                   at::arange(-6, 6, at::kDouble).mul(0.75).reshape({3, 4}).to(t));
  }
  d.insert("tensors", tensors);
  at::Tensor base = at::arange(24, at::kFloat);
  d.insert("base", base);
  d.insert("slice", base.narrow(0, 2, 6));
  d.insert("transposed", base.view({4, 6}).t());
  d.insert("strided", base.slice(0, 1, 24, 5));
  d.insert("empty", at::empty({0, 3}, at::kFloat));
  d.insert("scalar", at::scalar_tensor(2.5, at::kDouble));
  d.insert("grad", at::ones({2}, at::kFloat).requires_grad_(true));
  Dict keys(c10::AnyType::get(), c10::AnyType::get());
  keys.insert(int64_t{3}, std::string("int"));
  keys.insert(1.5, std::string("float"));
  keys.insert(true, std::string("bool"));
  d.insert("keys", keys);
  c10::impl::GenericList list(c10::AnyType::get());
  list.push_back(int64_t{-(int64_t{1} << 62)});
  list.push_back(std::numeric_limits<double>::quiet_NaN());
  list.push_back(-0.0);
  list.push_back(c10::ivalue::Tuple::create({c10::IValue(std::string("\xc3\xa9")), c10::IValue()}));
  list.push_back(c10::List<int64_t>({1, 2}));
  d.insert("list", list);
  return d;
}

TEST(StateFileTest, RoundTrip) {
  const std::string path = temp_dir() + "/ckpt.pt";
  ASSERT_TRUE(save_state(path, sample()).ok());
  auto back = load_state(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(digest(*back), digest(sample()));
}

// A file of 2 MiB or more is read into its own (huge-page advised) mapping that the tensors view:
// the values survive the file and every other reference, and are writable in place.
TEST(StateFileTest, LargeFilesRoundTripThroughTheirOwnMapping) {
  const std::string path = temp_dir() + "/large.pt";
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  const at::Tensor a = at::arange(int64_t{3} << 20, at::kFloat).mul_(0.5);  // 12 MiB
  const at::Tensor b = at::arange(1000, at::kDouble);
  d.insert("a", a);
  d.insert("b", b);
  ASSERT_TRUE(save_state(path, d).ok());
  at::Tensor got_a, got_b;
  {
    auto back = load_state(path);
    ASSERT_TRUE(back.ok()) << back.status();
    got_a = back->toGenericDict().at("a").toTensor();
    got_b = back->toGenericDict().at("b").toTensor();
  }
  std::remove(path.c_str());
  EXPECT_TRUE(got_a.equal(a));
  EXPECT_TRUE(got_b.equal(b));
  got_a.add_(1);  // the mapping is private and writable
  EXPECT_EQ(got_a[7].item<float>(), 4.5f);
}

// What load_state returns has the IValue types LibTorch's own unpickler gives the same file
// (other code calls toGenericDict(), toList(), toTensor() on it), and the values saved.
TEST(StateFileTest, RoundTripsEveryKindOfValueWithLibTorchsTypes) {
  const std::string path = temp_dir() + "/every.pt";
  ASSERT_TRUE(save_state(path, every_kind_of_value()).ok());
  auto back = load_state(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(digest(*back), digest(every_kind_of_value()));
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
  const c10::IValue libtorch = torch::jit::pickle_load(bytes);
  type_homogeneous_containers(libtorch);  // load_state types what is homogeneous (next test)
  std::vector<std::string> ours_types, libtorch_types;
  for (const auto& [v, out] :
       {std::make_pair(*back, &ours_types), std::make_pair(libtorch, &libtorch_types)}) {
    for (const auto& kv : v.toGenericDict())
      out->push_back(kv.key().toStringRef() + ": " + kv.value().type()->str());
    out->push_back(v.type()->str());
  }
  EXPECT_EQ(ours_types, libtorch_types);
  EXPECT_EQ(back->type()->str(), "Dict(str, Any)");
  const Dict d = back->toGenericDict();
  EXPECT_TRUE(
      d.at("slice").toTensor().storage().is_alias_of(d.at("transposed").toTensor().storage()));
  EXPECT_FALSE(d.at("transposed").toTensor().is_contiguous());
}

// Typed C++ containers come back typed where their contents say so (a pickle records no element
// types); mixed and empty ones as Any.
TEST(StateFileTest, TypedContainersComeBackTyped) {
  const std::string path = temp_dir() + "/typed.pt";
  Dict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("tensors", c10::List<at::Tensor>({at::ones({2}), at::arange(3, at::kDouble)}));
  c10::Dict<std::string, at::Tensor> named;
  named.insert("w", at::zeros({2, 2}));
  d.insert("named", named);
  d.insert("ints", c10::List<int64_t>({1, 2, 3}));
  d.insert("floats", c10::List<double>({0.5, 1.5}));
  d.insert("flags", c10::List<bool>({true, false}));
  d.insert("words", c10::List<std::string>({"a", "b"}));
  c10::impl::GenericList mixed(c10::AnyType::get());
  mixed.push_back(int64_t{1});
  mixed.push_back(std::string("a"));
  d.insert("mixed", mixed);
  d.insert("empty", c10::List<at::Tensor>());
  c10::impl::GenericList nested(c10::AnyType::get());
  nested.push_back(c10::List<at::Tensor>({at::ones({1})}));
  d.insert("nested", nested);
  ASSERT_TRUE(save_state(path, d).ok());
  auto back = load_state(path);
  ASSERT_TRUE(back.ok()) << back.status();
  const Dict b = back->toGenericDict();
  const std::vector<at::Tensor> tensors = b.at("tensors").toTensorVector();
  ASSERT_EQ(tensors.size(), 2u);
  EXPECT_TRUE(tensors[1].equal(at::arange(3, at::kDouble)));
  EXPECT_EQ(b.at("named").type()->str(), "Dict(str, Tensor)");
  EXPECT_TRUE(b.at("named").toGenericDict().at("w").toTensor().equal(at::zeros({2, 2})));
  EXPECT_EQ(b.at("ints").toIntVector(), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(b.at("floats").toDoubleVector(), (std::vector<double>{0.5, 1.5}));
  EXPECT_EQ(b.at("flags").type()->str(), "bool[]");
  EXPECT_EQ(b.at("words").type()->str(), "str[]");
  EXPECT_EQ(b.at("mixed").type()->str(), "Any[]");
  EXPECT_EQ(b.at("empty").type()->str(), "Any[]");  // the file cannot say what an empty list held
  EXPECT_EQ(b.at("nested").type()->str(), "Any[]");
  EXPECT_EQ(b.at("nested").toListRef()[0].toTensorVector().size(), 1u);
}

TEST(StateFileTest, PythonTorchLoadReadsTheSameDict) {
  const std::string path = temp_dir() + "/ckpt.pt";
  ASSERT_TRUE(save_state(path, every_kind_of_value()).ok());
  std::string output;
  const int rc = testing::run_command(
      absl::StrCat(testing::python_binary(), " ", testing::kScript, " digest ", path), &output);
  ASSERT_EQ(rc, 0) << "python failed (is python3-torch installed? ./bazelw installs it):\n"
                   << output;
  std::vector<std::string> lines;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    if (line.find("Warning") == std::string::npos &&
        (line.empty() || line[0] == ' ' || line[0] == '/')) {
      lines.push_back(line);
    }
  }
  // Python prints NaN's bits as it holds them; LibTorch's and Python's quiet NaN agree.
  EXPECT_EQ(lines, digest(every_kind_of_value())) << output;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(StateFileTest, AFifoOrADirectoryIsAnErrorNotAHang) {
  const std::string dir = temp_dir();
  ASSERT_EQ(::mkfifo((dir + "/fifo.pt").c_str(), 0600), 0);
  absl::StatusOr<c10::IValue> fifo =
      load_state(dir + "/fifo.pt");  // no writer: a blocking open never returns
  EXPECT_EQ(fifo.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(fifo.status().message()), HasSubstr("is not a regular file"));
  EXPECT_EQ(load_state(dir).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(StateFileTest, CorruptedTruncatedAndMissingFiles) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/ckpt.pt";
  ASSERT_TRUE(save_state(path, sample()).ok());
  const std::string good = read_all(path);

  std::string flipped = good;
  flipped[flipped.size() / 2] ^= 0x40;
  write_all(path, flipped);
  auto corrupted = load_state(path);
  EXPECT_EQ(corrupted.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(corrupted.status().message()),
              HasSubstr("state file " + path + " is corrupted: checksum"));

  write_all(path, good.substr(0, good.size() - 10));
  auto cut_trailer = load_state(path);
  EXPECT_EQ(cut_trailer.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(cut_trailer.status().message()), HasSubstr(path));

  write_all(path, good.substr(0, good.size() / 3));
  auto truncated = load_state(path);
  EXPECT_EQ(truncated.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(truncated.status().message()),
              HasSubstr("no end-of-central-directory record ends at the end"));

  write_all(path, "");
  EXPECT_THAT(std::string(load_state(path).status().message()),
              HasSubstr("only 0 bytes, too short for a zip"));

  auto missing = load_state(dir + "/nope.pt");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("state file " + dir + "/nope.pt does not exist"));

  auto no_dir = save_state("/nonexistent-dir/x.pt", sample());
  EXPECT_EQ(no_dir.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(no_dir.message()), HasSubstr("/nonexistent-dir/x.pt"));
}

// `good` with its end record's comment replaced by `comment`.
std::string with_comment(const std::string& good, const std::string& comment) {
  const size_t eocd = good.rfind("PK\x05\x06");
  std::string b = good.substr(0, eocd + 22);
  b[eocd + 20] = static_cast<char>(comment.size() & 0xff);
  b[eocd + 21] = static_cast<char>(comment.size() >> 8);
  return b + comment;
}

TEST(StateFileTest, TrailerMustVerifyAndEndTheFile) {
  const std::string path = temp_dir() + "/ckpt.pt";
  ASSERT_TRUE(save_state(path, sample()).ok());
  const std::string good = read_all(path);
  const size_t trailer = good.rfind("dtrain-state-file v1 crc32=");
  ASSERT_NE(trailer, std::string::npos);
  ASSERT_GE(good.size() - trailer, 42u) << good.substr(trailer);  // "...crc32=xxxxxxxx size=NNNN"
  auto expect_loss = [&](const std::string& bytes, const std::string& what,
                         const std::string& why) {
    write_all(path, bytes);
    absl::StatusOr<c10::IValue> v = load_state(path);
    EXPECT_EQ(v.status().code(), absl::StatusCode::kDataLoss) << why << ": " << v.status();
    EXPECT_THAT(std::string(v.status().message()), HasSubstr("state file " + path)) << why;
    EXPECT_THAT(std::string(v.status().message()), HasSubstr(what)) << why;
  };
  for (size_t cut = trailer; cut < good.size(); ++cut) {
    expect_loss(good.substr(0, cut), "the file was cut inside its trailer",
                absl::StrCat("cut at ", cut));
  }
  for (const std::string& tail :
       {std::string("x"), std::string(1000, '\0'), good.substr(trailer)}) {
    expect_loss(good + tail, "bytes were appended after its trailer",
                absl::StrCat(tail.size(), " bytes appended"));
  }
  for (size_t i = trailer; i < good.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string b = good;
      b[i] = static_cast<char>(b[i] ^ (1 << bit));
      write_all(path, b);
      absl::StatusOr<c10::IValue> v = load_state(path);
      EXPECT_EQ(v.status().code(), absl::StatusCode::kDataLoss)
          << "bit " << bit << " of byte " << i;
    }
  }
  expect_loss(with_comment(good, "dtrain-state-file v1 crc32=00000000 size=1"),
              "its trailer says 1 bytes", "wrong size");
  std::string other_crc = good;
  other_crc[trailer + 27] = other_crc[trailer + 27] == '0' ? '1' : '0';
  expect_loss(other_crc, "is corrupted: checksum", "another checksum");
  expect_loss(with_comment(good, "dtrain-state-file v2 crc32=xyz"),
              "its dtrain trailer (the zip comment) is malformed", "malformed");
}

// Without a trailer (as torch.save writes) or with a comment of another zip tool, the zip's
// per-entry CRC-32s protect the file: it loads, and damage is still caught.
TEST(StateFileTest, FilesWithoutTrailerAreVerifiedEntryByEntry) {
  const std::string path = temp_dir() + "/ckpt.pt";
  ASSERT_TRUE(save_state(path, sample()).ok());
  const std::string good = read_all(path);
  for (const std::string& comment : {std::string(), std::string("written by zip 3.0")}) {
    const std::string bytes = with_comment(good, comment);
    write_all(path, bytes);
    absl::StatusOr<c10::IValue> v = load_state(path);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(digest(*v), digest(sample()));
    std::string damaged = bytes;
    damaged[damaged.find("PK\x03\x04", 100) - 5] ^= 1;  // the last bytes of an entry's data
    write_all(path, damaged);
    v = load_state(path);
    EXPECT_EQ(v.status().code(), absl::StatusCode::kDataLoss) << v.status();
    EXPECT_THAT(std::string(v.status().message()), HasSubstr("fails its CRC-32 check"));
    EXPECT_THAT(std::string(v.status().message()), ::testing::Not(HasSubstr("truncated")));
  }
}

// The child half of KilledSaveLeavesPreviousFile: starts overwriting the file with a large state,
// reports after the first chunk and waits to be killed.
TEST(StateFileTest, KilledSaveLeavesPreviousFile) {
  if (const char* child = std::getenv("DTRAIN_SAVE_CHILD"); child != nullptr) {
    Dict big(c10::StringType::get(), c10::AnyType::get());
    big.insert("big", at::ones({int64_t{32} << 20}));  // 128 MiB
    SaveOptions o;
    o.write_chunk_bytes = 1 << 20;
    o.after_chunk = [](int64_t) {
      static bool told = false;
      if (!told) {
        told = true;
        [[maybe_unused]] ssize_t n = ::write(1, "x", 1);
        ::sleep(30);
      }
    };
    (void)save_state(child, big, o);
    std::_Exit(0);
  }
  const std::string path = temp_dir() + "/ckpt.pt";
  ASSERT_TRUE(save_state(path, sample()).ok());
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::setenv("DTRAIN_SAVE_CHILD", path.c_str(), 1);
    ::unsetenv("XML_OUTPUT_FILE");
    ::execl("/proc/self/exe", "/proc/self/exe",
            "--gtest_filter=StateFileTest.KilledSaveLeavesPreviousFile",
            static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  ::close(fds[1]);
  char c = 0;
  ASSERT_EQ(::read(fds[0], &c, 1), 1) << "the child never started writing";
  ::kill(pid, SIGKILL);  // mid-write: one chunk of 128 MiB is in the temporary file
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  auto back = load_state(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(digest(*back), digest(sample()));
}

}  // namespace
}  // namespace dtrain::checkpoint
