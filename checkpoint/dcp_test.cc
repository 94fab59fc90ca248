#include "checkpoint/dcp.h"

#include <malloc.h>
#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

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

const at::Tensor& w_full() {
  static const at::Tensor w = at::arange(30, at::kDouble).reshape({5, 6});
  return w;
}

// Rank r of 3 holds rows [2r, 2r + 2) of w (the last rank one row), like a ZeRO shard; rank 0 the
// replicated items.
std::vector<DcpWriteItem> items_of(int rank) {
  std::vector<DcpWriteItem> mine;
  const int64_t begin = 2 * rank;
  const int64_t rows = std::min<int64_t>(2, 5 - begin);
  mine.push_back(DcpWriteItem::chunk("w", {5, 6}, {begin, 0}, w_full().narrow(0, begin, rows)));
  if (rank == 0) {
    mine.push_back(DcpWriteItem::whole("b", at::arange(4, at::kFloat) + 0.5));
    mine.push_back(DcpWriteItem::whole("scalar", at::scalar_tensor(2.5)));
    mine.push_back(DcpWriteItem::object("step", int64_t{7}));
    mine.push_back(DcpWriteItem::object("group.lr", 0.001));
    mine.push_back(DcpWriteItem::object(
        "group.betas", c10::ivalue::Tuple::create({c10::IValue(0.9), c10::IValue(0.999)})));
  }
  return mine;
}

std::string save_three(const std::string& name) {
  const std::string dir = fresh_dir(name);
  comm::testing::run_ranks_as_threads(3, [&](comm::Group& g) {
    const absl::Status s = save_dcp(g, dir, items_of(g.rank()));
    ASSERT_TRUE(s.ok()) << s;
  });
  return dir;
}

TEST(DcpTest, EachRankWritesItsOwnChunksAndAnyBoxReadsBack) {
  const std::string dir = save_three("three");
  absl::StatusOr<DcpReader> r = DcpReader::open(dir);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->metadata().tensors.at("w").chunks.size(), 3u);
  absl::StatusOr<at::Tensor> w = r->tensor("w");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->equal(w_full()));
  // A box across two ranks' chunks reads those two only.
  const int64_t before = r->bytes_read();
  absl::StatusOr<at::Tensor> box = r->tensor("w", {1, 2}, {2, 3});
  ASSERT_TRUE(box.ok()) << box.status();
  EXPECT_TRUE(box->equal(w_full().narrow(0, 1, 2).narrow(1, 2, 3)));
  const auto& chunks = r->metadata().tensors.at("w").chunks;
  EXPECT_EQ(r->bytes_read() - before, chunks[0].storage.length + chunks[1].storage.length);
  EXPECT_EQ(r->tensor("scalar")->dim(), 0);
  EXPECT_EQ(r->tensor("scalar")->item<float>(), 2.5f);
  EXPECT_EQ(r->value("step")->toInt(), 7);
  EXPECT_EQ(r->value("group.lr")->toDouble(), 0.001);
  EXPECT_EQ(r->tensor("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r->tensor("w", {4, 0}, {2, 6}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r->value("w").status().code(), absl::StatusCode::kNotFound);
}

// A /proc/self/status field (VmRSS, VmHWM) in bytes; -1 when there is none.
int64_t status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

// What a resharding load costs in memory: the box it returns plus one chunk's bytes at a time
// (the reader preads one chunk, copies its overlap out, and lets it go), measured on the resident
// set's high-water mark. A 48 MiB tensor saved by 2 ranks (two 24 MiB chunks) is read as the
// middle third a rank of 3 owns (16 MiB, straddling both chunks).
TEST(DcpTest, AReshardingLoadHoldsItsBoxAndOneChunkAtATime) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "under ASan the resident set counts shadow memory and quarantined frees";
#else
  // Every large block its own mapping, returned at free (glibc would otherwise raise the threshold
  // after the first free and keep freed blocks resident, hiding what a load allocates).
  ASSERT_EQ(mallopt(M_MMAP_THRESHOLD, 1 << 20), 1);
  constexpr int64_t kRows = 3072, kCols = 4096, kMiB = 1 << 20;
  const std::string dir = fresh_dir("peak");
  comm::testing::run_ranks_as_threads(2, [&](comm::Group& g) {
    const at::Tensor half = at::full({kRows / 2, kCols}, g.rank() + 1.0f, at::kFloat);
    const absl::Status s = save_dcp(
        g, dir, {DcpWriteItem::chunk("w", {kRows, kCols}, {g.rank() * kRows / 2, 0}, half)});
    ASSERT_TRUE(s.ok()) << s;
  });
  absl::StatusOr<DcpReader> r = DcpReader::open(dir);
  ASSERT_TRUE(r.ok()) << r.status();
  {
    std::ofstream reset("/proc/self/clear_refs");
    reset << "5";  // VmHWM := VmRSS
    if (!reset.flush() || status_bytes("VmHWM") < 0) GTEST_SKIP() << "no resettable VmHWM here";
  }
  const int64_t before = status_bytes("VmRSS");
  absl::StatusOr<at::Tensor> box = r->tensor("w", {kRows / 3, 0}, {kRows / 3, kCols});
  const int64_t extra = status_bytes("VmHWM") - before;
  ASSERT_TRUE(box.ok()) << box.status();
  const int64_t box_bytes = box->nbytes(), chunk_bytes = kRows / 2 * kCols * 4;
  std::printf("resharding load: peak extra %.1f MiB for a %.1f MiB box of 2 chunks of %.1f MiB\n",
              static_cast<double>(extra) / kMiB, static_cast<double>(box_bytes) / kMiB,
              static_cast<double>(chunk_bytes) / kMiB);
  EXPECT_LE(extra, box_bytes + chunk_bytes + 4 * kMiB);
  EXPECT_TRUE(box->narrow(0, 0, kRows / 6).eq(1.0f).all().item<bool>());
  EXPECT_TRUE(box->narrow(0, kRows / 6, kRows / 6).eq(2.0f).all().item<bool>());
#endif
}

TEST(DcpTest, PyTorchLoadsWhatDtrainSaved) {
  const std::string dir = save_three("for_python");
  std::string output;
  ASSERT_EQ(t::run_command(absl::StrCat(t::python_binary(),
                                        " checkpoint/testdata/make_dcp_files.py load ", dir),
                           &output),
            0)
      << output;
  std::string w = "w [";
  for (int i = 0; i < 30; ++i) absl::StrAppend(&w, i ? ", " : "", i, ".0");
  EXPECT_THAT(output, HasSubstr(w + "]"));
  EXPECT_THAT(output, HasSubstr("b [0.5, 1.5, 2.5, 3.5]"));
  EXPECT_THAT(output, HasSubstr("scalar 2.5"));
  EXPECT_THAT(output, HasSubstr("step 7"));
  EXPECT_THAT(output, HasSubstr("group 0.001 (0.9, 0.999)"));
  EXPECT_THAT(output,
              HasSubstr("dcp_to_torch_save ['b', 'group', 'scalar', 'step', 'w'] 0.001 True"));
}

TEST(DcpTest, ReadsPyTorchsShardedCheckpointAtAnotherWorldSize) {
  const std::string dir = fresh_dir("from_python");
  std::string output;
  ASSERT_EQ(t::run_command(absl::StrCat(t::python_binary(),
                                        " checkpoint/testdata/make_dcp_files.py write ", dir),
                           &output),
            0)
      << output;
  absl::StatusOr<DcpReader> r = DcpReader::open(dir + "/sharded");
  ASSERT_TRUE(r.ok()) << r.status();
  // Saved by 2 ranks (rows 0-2, 3-4); read as 3 ranks would: rows 0-1, 2-3, 4.
  for (const auto& [begin, rows] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 2}, {4, 1}}) {
    absl::StatusOr<at::Tensor> part = r->tensor("w", {begin, 0}, {rows, 6});
    ASSERT_TRUE(part.ok()) << part.status();
    EXPECT_TRUE(part->equal(w_full().narrow(0, begin, rows)));
  }
  EXPECT_EQ(r->value("step")->toInt(), 7);
  EXPECT_TRUE(r->tensor("b")->equal(at::arange(4, at::kFloat)));
}

TEST(DcpTest, RefusesWhatIsNotACheckpoint) {
  const std::string dir = fresh_dir("refusals");
  // Two ranks both writing a whole tensor: the chunks overlap; every rank hears it.
  comm::testing::run_ranks_as_threads(2, [&](comm::Group& g) {
    const absl::Status s = save_dcp(g, dir, {DcpWriteItem::whole("x", at::ones({3}))});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("'x'"));
  });
  EXPECT_EQ(DcpReader::open(dir).status().code(), absl::StatusCode::kNotFound);
  // A value written by two ranks, a chunk outside its tensor.
  comm::testing::run_ranks_as_threads(2, [&](comm::Group& g) {
    absl::Status s = save_dcp(g, dir, {DcpWriteItem::object("lr", 0.1)});
    EXPECT_THAT(s.message(), HasSubstr("'lr' is written by ranks 0 and 1"));
    s = save_dcp(g, dir, {DcpWriteItem::chunk("y", {4}, {g.rank() * 3}, at::ones({2}))});
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;  // rank 1's chunk [3, 5) of 4
    EXPECT_THAT(s.message(), HasSubstr("outside the tensor"));
  });
  // A directory holding a checkpoint is not overwritten by default.
  const std::string done = save_three("twice");
  comm::testing::run_ranks_as_threads(3, [&](comm::Group& g) {
    const absl::Status s = save_dcp(g, done, items_of(g.rank()));
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    DcpSaveOptions o;
    o.overwrite = true;
    EXPECT_TRUE(save_dcp(g, done, items_of(g.rank()), o).ok());
  });
  // An item that is not what the metadata says (a chunk file swapped for another's bytes).
  std::string out;
  t::run_command(
      absl::StrCat("cp '", done, "/__2_0.distcp' '", done, "/__1_0.distcp.x' && head -c ",
                   "$(stat -c %s '", done, "/__1_0.distcp') /dev/zero > '", done, "/__1_0.distcp'"),
      &out);
  absl::StatusOr<DcpReader> r = DcpReader::open(done);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tensor("w").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(r->tensor("w", {0, 0}, {2, 6}).ok());  // rank 0's chunk is intact
}

}  // namespace
}  // namespace dtrain::checkpoint
