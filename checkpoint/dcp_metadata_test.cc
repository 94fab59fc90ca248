#include "checkpoint/dcp_metadata.h"

#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/python_test_files.h"

namespace dtrain::checkpoint {
namespace {

using ::testing::HasSubstr;
namespace t = ::dtrain::checkpoint::testing;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string dims(const std::vector<int64_t>& v) {
  return v.empty() ? "scalar" : absl::StrJoin(v, "x");
}

// The summary make_dcp_files.py prints, from dtrain's reading.
std::vector<std::string> summary(const DcpMetadata& md) {
  std::vector<std::string> lines;
  for (const auto& [key, s] : md.objects)
    lines.push_back(
        absl::StrCat("bytes ", key, " ", s.relative_path, " ", s.offset, " ", s.length));
  for (const auto& [key, tensor] : md.tensors) {
    const char* dtype = tensor.dtype == at::kFloat    ? "float32"
                        : tensor.dtype == at::kDouble ? "float64"
                                                      : "other";
    std::string line = absl::StrCat("tensor ", key, " torch.", dtype, " ", dims(tensor.size));
    std::vector<DcpChunk> chunks = tensor.chunks;
    std::sort(chunks.begin(), chunks.end(),
              [](const DcpChunk& a, const DcpChunk& b) { return a.offsets < b.offsets; });
    for (const DcpChunk& c : chunks) {
      absl::StrAppend(&line, " [", dims(c.offsets), " ", dims(c.sizes), " ",
                      c.storage.relative_path, " ", c.storage.offset, " ", c.storage.length, "]");
    }
    lines.push_back(line);
  }
  std::sort(lines.begin(), lines.end());
  return lines;
}

const std::string& python_dir() {
  static const std::string dir = [] {
    const std::string out = t::test_tmpdir() + "/dcp_python";
    std::string output;
    const int rc = t::run_command(
        absl::StrCat(t::python_binary(), " checkpoint/testdata/make_dcp_files.py write ", out),
        &output);
    EXPECT_EQ(rc, 0) << output;
    return out;
  }();
  return dir;
}

TEST(DcpMetadataTest, ReadsWhatPyTorchWrites) {
  for (const char* name : {"plain", "sharded"}) {
    const std::string dir = absl::StrCat(python_dir(), "/", name);
    absl::StatusOr<DcpMetadata> md = read_dcp_metadata(slurp(dir + "/.metadata"), dir);
    ASSERT_TRUE(md.ok()) << md.status();
    EXPECT_EQ(summary(*md), t::read_lines(dir + "/summary.txt")) << name;
    // PyTorch 2.6 writes no version; later ones "1.0.0".
    EXPECT_TRUE(md->version == "1.0.0" || md->version.empty()) << md->version;
    EXPECT_FALSE(md->save_id.empty());
    std::map<std::string, int64_t> sizes;
    for (const char* f : {"__0_0.distcp", "__1_0.distcp"}) {
      const std::string bytes = slurp(dir + "/" + f);
      if (!bytes.empty()) sizes[f] = static_cast<int64_t>(bytes.size());
    }
    EXPECT_TRUE(check_dcp_files(*md, sizes, dir).ok());
  }
  absl::StatusOr<DcpMetadata> plain =
      read_dcp_metadata(slurp(python_dir() + "/plain/.metadata"), "plain");
  ASSERT_TRUE(plain.ok());
  // planner_data: list indices are ints, module names keep their dots.
  EXPECT_EQ(
      plain->paths.at("optim.param_groups.0.lr"),
      (DcpPath{std::string("optim"), std::string("param_groups"), int64_t{0}, std::string("lr")}));
  EXPECT_EQ(plain->paths.at("model.0.weight"),
            (DcpPath{std::string("model"), std::string("0.weight")}));
}

// checkpoint/testdata/torch_2_15.metadata: dcp.save({"model.weight": torch.arange(12.).reshape(4,
// 3), "step": 7}, no_dist=True) by PyTorch 2.15.0 under Python 3.11, which pickles the memory
// format by name: getattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT") (2.14's pickles hold no
// getattr). Kept as a file: the test roots' PyTorch cannot write it.
TEST(DcpMetadataTest, ReadsPyTorch215sEnumMembersPickledByName) {
  const std::string bytes = slurp("checkpoint/testdata/torch_2_15.metadata");
  ASSERT_NE(bytes.find("getattr"), std::string::npos);
  absl::StatusOr<DcpMetadata> md = read_dcp_metadata(bytes, "torch_2_15");
  ASSERT_TRUE(md.ok()) << md.status();
  ASSERT_EQ(md->tensors.count("model.weight"), 1u);
  const DcpTensor& w = md->tensors.at("model.weight");
  EXPECT_EQ(w.dtype, at::kFloat);
  EXPECT_EQ(w.size, (std::vector<int64_t>{4, 3}));
  ASSERT_EQ(w.chunks.size(), 1u);
  EXPECT_EQ(md->objects.count("step"), 1u);
  EXPECT_EQ(md->version, "1.0.0");
}

DcpMetadata two_chunks() {
  DcpMetadata md;
  DcpTensor w;
  w.dtype = at::kDouble;
  w.size = {5, 6};
  w.chunks.push_back({{0, 0}, {3, 6}, {"__0_0.distcp", 0, 100}});
  w.chunks.push_back({{3, 0}, {2, 6}, {"__1_0.distcp", 0, 90}});
  md.tensors["w"] = w;
  DcpTensor step;
  step.chunks.push_back({{}, {}, {"__0_0.distcp", 100, 50}});
  md.tensors["optim.state.0.weight.step"] = step;
  md.objects["optim.param_groups.0.lr"] = {"__0_0.distcp", 150, 20};
  md.paths["optim.param_groups.0.lr"] = {std::string("optim"), std::string("param_groups"),
                                         int64_t{0}, std::string("lr")};
  md.save_id = "abc";
  return md;
}

TEST(DcpMetadataTest, WritesWhatItAndPyTorchRead) {
  const DcpMetadata md = two_chunks();
  const std::string bytes = write_dcp_metadata(md);
  absl::StatusOr<DcpMetadata> back = read_dcp_metadata(bytes, "mine");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(summary(*back), summary(md));
  EXPECT_EQ(back->paths.at("optim.param_groups.0.lr"), md.paths.at("optim.param_groups.0.lr"));
  EXPECT_EQ(back->paths.at("optim.state.0.weight.step"),
            (DcpPath{std::string("optim"), std::string("state"), std::string("0"),
                     std::string("weight"), std::string("step")}));
  EXPECT_EQ(back->save_id, "abc");
  // PyTorch's pickle.load reads it as the same metadata.
  const std::string dir = t::test_tmpdir() + "/dcp_mine";
  std::string output;
  ASSERT_EQ(t::run_command("mkdir -p " + dir, &output), 0);
  std::ofstream(dir + "/.metadata", std::ios::binary) << bytes;
  output.clear();
  ASSERT_EQ(t::run_command(absl::StrCat(t::python_binary(),
                                        " checkpoint/testdata/make_dcp_files.py read ", dir),
                           &output),
            0)
      << output;
  EXPECT_EQ(output, absl::StrCat(absl::StrJoin(summary(md), "\n"), "\n"));
}

absl::Status read_written(const DcpMetadata& md) {
  return read_dcp_metadata(write_dcp_metadata(md), "ckpt").status();
}

TEST(DcpMetadataTest, RefusesChunksThatDoNotTileTheTensor) {
  DcpMetadata md = two_chunks();
  md.tensors["w"].chunks[1].offsets = {2, 0};  // rows 2-3 overlap, row 4 missing
  EXPECT_THAT(read_written(md).message(), HasSubstr("'w'"));
  md = two_chunks();
  md.tensors["w"].chunks[1].sizes = {1, 6};
  EXPECT_THAT(read_written(md).message(), HasSubstr("'w''s chunks leave holes"));
  md = two_chunks();
  md.tensors["w"].chunks[1].sizes = {3, 6};
  EXPECT_THAT(read_written(md).message(), HasSubstr("'w' has a chunk outside the tensor"));
  md = two_chunks();
  // 15 + 12 + 3 elements: the volume matches, but the third overlaps both and column 5 is empty.
  md.tensors["w"].chunks[0].sizes = {3, 5};
  md.tensors["w"].chunks.push_back({{1, 1}, {3, 1}, {"__2_0.distcp", 0, 10}});
  EXPECT_THAT(read_written(md).message(), HasSubstr("'w''s chunks overlap"));
  md = two_chunks();
  md.tensors["w"].chunks[0].offsets = {0};
  EXPECT_THAT(read_written(md).message(), HasSubstr("another number of dimensions"));
}

TEST(DcpMetadataTest, RefusesPathsOutsideTheCheckpoint) {
  for (const char* path : {"../etc/passwd", "/etc/passwd", "", "..", "a/b"}) {
    DcpMetadata md = two_chunks();
    md.objects["optim.param_groups.0.lr"].relative_path = path;
    const absl::Status s = read_written(md);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << path;
    EXPECT_THAT(s.message(), HasSubstr("not a plain file name")) << path;
  }
  DcpMetadata md = two_chunks();
  md.objects["optim.param_groups.0.lr"].offset = -1;
  EXPECT_THAT(read_written(md).message(), HasSubstr("negative offset"));
}

TEST(DcpMetadataTest, ChecksItemsAgainstTheFiles) {
  const DcpMetadata md = two_chunks();
  EXPECT_TRUE(check_dcp_files(md, {{"__0_0.distcp", 170}, {"__1_0.distcp", 90}}, "c").ok());
  EXPECT_THAT(check_dcp_files(md, {{"__0_0.distcp", 170}}, "c").message(),
              HasSubstr("'w' is in __1_0.distcp, which the checkpoint does not have"));
  EXPECT_THAT(check_dcp_files(md, {{"__0_0.distcp", 169}, {"__1_0.distcp", 90}}, "c").message(),
              HasSubstr("runs past the end of __0_0.distcp"));
  DcpMetadata overlapping = md;
  overlapping.objects["optim.param_groups.0.lr"].offset = 140;
  EXPECT_THAT(
      check_dcp_files(overlapping, {{"__0_0.distcp", 170}, {"__1_0.distcp", 90}}, "c").message(),
      HasSubstr("overlap in __0_0.distcp"));
}

TEST(DcpMetadataTest, RunsNoCodeFromTheFile) {
  // pickle.dumps(os.system("true")) and a dataclass from outside DCP.
  static constexpr char kSystem[] =
      "\x80\x02"
      "cposix\nsystem\nX\x04\x00\x00\x00true\x85R.";
  static constexpr char kField[] =
      "\x80\x02"
      "cdataclasses\nField\n)\x81.";
  for (const std::string& p :
       {std::string(kSystem, sizeof(kSystem) - 1), std::string(kField, sizeof(kField) - 1)}) {
    const absl::Status s = read_dcp_metadata(p, "ckpt").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(),
                HasSubstr("not one of torch.distributed.checkpoint's metadata classes"));
  }
  // getattr only on _MEM_FORMAT_ENCODING and only for its members.
  static constexpr char kGetattr[] =
      "\x80\x02"
      "cbuiltins\ngetattr\n"
      "ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
      "X\x08\x00\x00\x00__init__\x86R.";
  const absl::Status g =
      read_dcp_metadata(std::string(kGetattr, sizeof(kGetattr) - 1), "ckpt").status();
  EXPECT_EQ(g.code(), absl::StatusCode::kInvalidArgument) << g;
  EXPECT_THAT(g.message(), HasSubstr("builtins.getattr is called on something other than"));
  // Storages (a tensor pickled into the metadata) have no place there.
  EXPECT_FALSE(read_dcp_metadata("\x80\x02}.", "ckpt").ok());
}

TEST(DcpMetadataTest, EveryTruncationAndByteFlipIsAStatus) {
  const std::string good = slurp(python_dir() + "/sharded/.metadata");
  ASSERT_FALSE(good.empty());
  int refused = 0;
  for (size_t n = 0; n < good.size(); ++n) {
    refused += !read_dcp_metadata(good.substr(0, n), "cut").ok();
  }
  EXPECT_EQ(refused, static_cast<int>(good.size()));
  for (size_t i = 0; i < good.size(); ++i) {
    for (unsigned char x : {0x01, 0x80, 0xff}) {
      std::string bad = good;
      bad[i] = static_cast<char>(static_cast<unsigned char>(bad[i]) ^ x);
      absl::StatusOr<DcpMetadata> md = read_dcp_metadata(bad, "flipped");
      if (md.ok()) {
        (void)check_dcp_files(*md, {{"__0_0.distcp", 4000}, {"__1_0.distcp", 4000}}, "flipped");
      }
    }
  }
}

}  // namespace
}  // namespace dtrain::checkpoint
