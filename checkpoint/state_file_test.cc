#include "checkpoint/state_file.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_format.h"

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

// One line per leaf, "path kind details", the way the Python side below prints it.
void digest(const std::string& prefix, const c10::IValue& v, std::vector<std::string>& out) {
  if (v.isGenericDict() || v.isList()) {
    std::vector<std::pair<std::string, c10::IValue>> items;
    if (v.isList()) {
      const auto list = v.toList();
      for (size_t i = 0; i < list.size(); ++i) items.emplace_back(std::to_string(i), list.get(i));
    } else {
      for (const auto& kv : v.toGenericDict()) {
        items.emplace_back(kv.key().isInt() ? std::to_string(kv.key().toInt()) : kv.key().toStringRef(), kv.value());
      }
    }
    std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [k, child] : items) digest(prefix + "/" + k, child, out);
  } else if (v.isTensor()) {
    at::Tensor t = v.toTensor().contiguous();
    std::string shape;
    for (size_t i = 0; i < static_cast<size_t>(t.dim()); ++i) shape += (i ? ", " : "") + std::to_string(t.size(i));
    const std::map<at::ScalarType, std::string> names = {{at::kFloat, "torch.float32"}, {at::kDouble, "torch.float64"},
                                                         {at::kLong, "torch.int64"}, {at::kBool, "torch.bool"}};
    const uint32_t crc = static_cast<uint32_t>(crc32(0, static_cast<const Bytef*>(t.data_ptr()), t.nbytes()));
    out.push_back(absl::StrFormat("%s tensor %s [%s] %08x", prefix, names.at(t.scalar_type()), shape, crc));
  } else if (v.isBool()) {
    out.push_back(prefix + (v.toBool() ? " bool True" : " bool False"));
  } else if (v.isInt()) {
    out.push_back(prefix + " int " + std::to_string(v.toInt()));
  } else if (v.isDouble()) {
    out.push_back(absl::StrFormat("%s float %.17g", prefix, v.toDouble()));
  } else if (v.isString()) {
    out.push_back(prefix + " str '" + v.toStringRef() + "'");
  } else if (v.isNone()) {
    out.push_back(prefix + " NoneType None");
  }
}

constexpr char kPythonDigest[] = R"(
import sys, zlib, torch
def walk(prefix, v, out):
    if isinstance(v, dict):
        for k in sorted(v, key=str):
            walk(prefix + '/' + str(k), v[k], out)
    elif torch.is_tensor(v):
        t = v.contiguous()
        out.append('%s tensor %s [%s] %08x' % (prefix, t.dtype, ', '.join(str(s) for s in t.shape),
                                               zlib.crc32(t.numpy().tobytes())))
    elif isinstance(v, list):
        for i in sorted(range(len(v)), key=str):
            walk(prefix + '/' + str(i), v[i], out)
    elif isinstance(v, bool) or v is None or isinstance(v, str):
        out.append('%s %s %r' % (prefix, type(v).__name__, v))
    elif isinstance(v, int):
        out.append('%s int %d' % (prefix, v))
    elif isinstance(v, float):
        out.append('%s float %.17g' % (prefix, v))
out = []
walk('', torch.load(sys.argv[1], weights_only=tuple(int(x) for x in torch.__version__.split('.')[:2]) >= (2, 0)), out)
print('\n'.join(out))
)";

TEST(StateFileTest, RoundTrip) {
  const std::string path = temp_dir() + "/ckpt.pt";
  ASSERT_TRUE(save_state(path, sample()).ok());
  auto back = load_state(path);
  ASSERT_TRUE(back.ok()) << back.status();
  std::vector<std::string> want, got;
  digest("", sample(), want);
  digest("", *back, got);
  EXPECT_EQ(got, want);
}

TEST(StateFileTest, PythonTorchLoadReadsTheSameDict) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/ckpt.pt";
  ASSERT_TRUE(save_state(path, sample()).ok());
  const std::string script = dir + "/digest.py";
  std::ofstream(script) << kPythonDigest;
  FILE* p = ::popen(("/usr/bin/python3 " + script + " " + path + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string output;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) output.append(buf, n);
  const int rc = ::pclose(p);
  ASSERT_EQ(rc, 0) << "python3 failed (is python3-torch installed? ./bazelw installs it):\n" << output;
  std::vector<std::string> want;
  digest("", sample(), want);
  std::vector<std::string> lines;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    if (line.find("Warning") == std::string::npos && !line.empty() && line[0] == '/') lines.push_back(line);
  }
  EXPECT_EQ(lines, want) << output;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_all(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

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
  EXPECT_THAT(std::string(corrupted.status().message()), HasSubstr("state file " + path + " is corrupted: checksum"));

  write_all(path, good.substr(0, good.size() - 10));
  auto cut_trailer = load_state(path);
  EXPECT_EQ(cut_trailer.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(cut_trailer.status().message()), HasSubstr(path));

  write_all(path, good.substr(0, good.size() / 3));
  auto truncated = load_state(path);
  EXPECT_EQ(truncated.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(truncated.status().message()), HasSubstr("no end-of-central-directory record ends at the end"));

  write_all(path, "");
  EXPECT_THAT(std::string(load_state(path).status().message()), HasSubstr("only 0 bytes, too short for a zip"));

  auto missing = load_state(dir + "/nope.pt");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("state file " + dir + "/nope.pt does not exist"));

  auto no_dir = save_state("/nonexistent-dir/x.pt", sample());
  EXPECT_EQ(no_dir.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(no_dir.message()), HasSubstr("/nonexistent-dir/x.pt"));
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
    ::execl("/proc/self/exe", "/proc/self/exe", "--gtest_filter=StateFileTest.KilledSaveLeavesPreviousFile",
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
  std::vector<std::string> want, got;
  digest("", sample(), want);
  digest("", *back, got);
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace dtrain::checkpoint
