#include "checkpoint/dcp_async.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "absl/strings/str_cat.h"
#include "checkpoint/python_test_files.h"
#include "comm/testing/test_harness.h"

namespace dtrain::checkpoint {
namespace {

using ::testing::HasSubstr;
namespace t = ::dtrain::checkpoint::testing;

std::string fresh_dir(const std::string& name) {
  const std::string dir = absl::StrCat(t::test_tmpdir(), "/", name);
  std::string out;
  t::run_command(absl::StrCat("rm -rf '", dir, "' && mkdir -p '", dir, "'"), &out);
  return dir;
}

TEST(AsyncDcpSaverTest, ReturnsOnceStagedAndTheTensorsMayChange) {
  const std::string dir = fresh_dir("staged");
  comm::testing::run_ranks_as_threads(2, [&](comm::Group& g) {
    absl::StatusOr<comm::Group> saves = comm::new_group(g, {0, 1});
    ASSERT_TRUE(saves.ok()) << saves.status();
    AsyncDcpSaver saver(*saves);
    at::Tensor mine = at::full({1000}, static_cast<double>(g.rank() + 1));
    ASSERT_TRUE(saver.save(dir, {DcpWriteItem::chunk("x", {2000}, {g.rank() * 1000}, mine)}).ok());
    mine.fill_(-1);  // after save() returns, the checkpoint no longer depends on it
    std::vector<at::Tensor> t = {at::ones({1})};
    g->allreduce(t)->wait();  // training goes on, on its own group
    const absl::Status s = saver.wait();
    ASSERT_TRUE(s.ok()) << s;
  });
  absl::StatusOr<DcpReader> r = DcpReader::open(dir);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->tensor("x")->narrow(0, 0, 1000).equal(at::full({1000}, 1.0, at::kDouble)));
  EXPECT_TRUE(r->tensor("x")->narrow(0, 1000, 1000).equal(at::full({1000}, 2.0, at::kDouble)));
}

TEST(AsyncDcpSaverTest, AFailedWriteIsReportedAtTheNextSave) {
  const std::string dir = fresh_dir("failed");
  comm::testing::run_ranks_as_threads(2, [&](comm::Group& g) {
    absl::StatusOr<comm::Group> saves = comm::new_group(g, {0, 1});
    ASSERT_TRUE(saves.ok());
    AsyncDcpSaver saver(*saves);
    const std::vector<DcpWriteItem> items = {
        DcpWriteItem::chunk("x", {2}, {g.rank()}, at::ones({1}))};
    ASSERT_TRUE(saver.save(dir + "/missing", items).ok());  // staged; the write fails later
    const absl::Status s = saver.save(dir, items);
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_THAT(s.message(), HasSubstr("the previous asynchronous save failed"));
    EXPECT_THAT(s.message(), HasSubstr("missing is not a directory"));
    EXPECT_TRUE(saver.wait().ok());  // reported once; nothing is in flight
    ASSERT_TRUE(saver.save(dir, items).ok());
    EXPECT_TRUE(saver.wait().ok());
  });
  EXPECT_TRUE(DcpReader::open(dir).ok());
}

// The child: async saves of step k (a tensor full of k, 4 MiB) into dir/step<k>, forever.
[[noreturn]] void save_forever(const std::string& dir) {
  comm::InitOptions o;
  o.store = c10::make_intrusive<c10d::HashStore>();
  o.rank = 0;
  o.world_size = 1;
  absl::StatusOr<comm::Group> g = comm::init_process_group(o);
  if (!g.ok()) ::_exit(3);
  AsyncDcpSaver saver(*g);
  for (int64_t k = 0;; ++k) {
    const std::string d = absl::StrCat(dir, "/step", k);
    if (std::system(absl::StrCat("mkdir -p '", d, "'").c_str()) != 0) ::_exit(4);
    const std::vector<DcpWriteItem> items = {
        DcpWriteItem::whole("w", at::full({1 << 20}, static_cast<float>(k))),
        DcpWriteItem::object("step", k)};
    if (!saver.save(d, items).ok()) ::_exit(5);
  }
}

// Kills a saving process at random moments, many times: every checkpoint with a .metadata must
// load whole and hold its own step's values; at most the newest directory may lack one.
TEST(AsyncDcpSaverTest, AKillAtAnyMomentLeavesEveryCompletedCheckpointLoadable) {
  std::mt19937 rng(12345);
  int kills = 0, complete = 0, in_flight = 0, corrupt = 0, lost = 0;
  for (int round = 0; round < 20; ++round) {
    const std::string dir = fresh_dir(absl::StrCat("killed", round));
    std::fflush(nullptr);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) save_forever(dir);
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 400));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the saving process ended by itself: " << status;
    ++kills;
    int64_t newest = -1;
    std::vector<int64_t> missing;
    for (int64_t k = 0;; ++k) {
      const std::string d = absl::StrCat(dir, "/step", k);
      if (::access(d.c_str(), F_OK) != 0) break;
      newest = k;
      absl::StatusOr<DcpReader> r = DcpReader::open(d);
      if (r.status().code() == absl::StatusCode::kNotFound) {
        missing.push_back(k);
        continue;
      }
      absl::StatusOr<at::Tensor> w = r.ok() ? r->tensor("w") : r.status();
      absl::StatusOr<c10::IValue> step = r.ok() ? r->value("step") : r.status();
      if (!w.ok() || !step.ok() || step->toInt() != k ||
          !w->equal(at::full({1 << 20}, static_cast<float>(k)))) {
        ++corrupt;
        ADD_FAILURE() << d << ": " << (r.ok() ? w.status() : r.status());
      } else {
        ++complete;
      }
    }
    for (int64_t k : missing) {
      // Only the save in flight (the newest directory, or the one before a just-made one) may be
      // incomplete.
      if (k >= newest - 1) {
        ++in_flight;
      } else {
        ++lost;
        ADD_FAILURE() << dir << "/step" << k << " has no .metadata but later saves finished";
      }
    }
  }
  std::printf(
      "async-save kill campaign: %d kills, %d complete checkpoints loaded, %d in flight "
      "(no .metadata), %d corrupt, %d lost\n",
      kills, complete, in_flight, corrupt, lost);
  EXPECT_EQ(corrupt, 0);
  EXPECT_EQ(lost, 0);
  EXPECT_GT(complete, 0);
}

}  // namespace
}  // namespace dtrain::checkpoint
