// checkpoint/ with CUDA tensors (tags = ["gpu"]; comm/testing/gpu_testing.h: each case skips without a
// GPU, fails instead under DTRAIN_REQUIRE_GPU=1): state files written from the GPU are the files
// the same tensors on the CPU give (views of one CUDA storage stay one storage), load back onto
// the CPU or, with map_location, the GPU with their storages shared; consolidation and sharded
// checkpoints of GPU state over NCCL (world of one: one GPU) and Gloo (two ranks sharing it).
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "checkpoint/consolidation.h"
#include "checkpoint/sharded.h"
#include "checkpoint/state_file.h"
#include "checkpoint/torch_file_writer.h"
#include "comm/testing/gpu_testing.h"
#include "comm/testing/test_harness.h"
#include "testing/test_util.h"

namespace dtrain::checkpoint {
namespace {

using Dict = c10::impl::GenericDict;

const at::Device kGpu(at::kCUDA, 0);

using test_util::str_dict;

std::string temp_dir() {
  char dir[] = "/tmp/dtrain_checkpoint_gpu_XXXXXX";
  EXPECT_NE(::mkdtemp(dir), nullptr);
  return dir;
}

// The same state built over `base` wherever it lives: views of one storage, the same tensor twice,
// a bool mask, a tensor requiring grad, and a CPU tensor beside them.
Dict state_over(const at::Tensor& base) {
  Dict d = str_dict();
  d.insert("base", base);
  d.insert("row", base.narrow(0, 4, 4));
  d.insert("transposed", base.view({4, 6}).t());
  d.insert("again", base);
  d.insert("mask", base.gt(11.5));
  d.insert("grad", base.narrow(0, 0, 3).mul(0.5).detach().requires_grad_());
  d.insert("on_cpu", at::arange(3, at::kLong));
  return d;
}

const void* storage_of(const Dict& d, const char* key) {
  return d.at(key).toTensor().storage().unsafeGetStorageImpl();
}

TEST(CheckpointGpuTest, WritesCudaTensorsAsTheirCpuTwins) {
  DTRAIN_GPU_TEST_OR_SKIP();
  const at::Tensor base = at::arange(24, at::TensorOptions().dtype(at::kFloat).device(kGpu));
  absl::StatusOr<std::string> from_gpu = write_torch_file(state_over(base));
  absl::StatusOr<std::string> from_cpu = write_torch_file(state_over(base.cpu()));
  ASSERT_TRUE(from_gpu.ok()) << from_gpu.status();
  ASSERT_TRUE(from_cpu.ok()) << from_cpu.status();
  // Byte for byte: one storage for base, row, transposed and again; location 'cpu' throughout.
  EXPECT_TRUE(*from_gpu == *from_cpu) << "the file written from the GPU differs from the CPU one";
}

TEST(CheckpointGpuTest, LoadsOntoTheCpuOrWithMapLocationTheGpu) {
  DTRAIN_GPU_TEST_OR_SKIP();
  const at::Tensor base = at::arange(24, at::TensorOptions().dtype(at::kFloat).device(kGpu));
  const Dict saved = state_over(base);
  const std::string path = temp_dir() + "/state.pt";
  ASSERT_TRUE(save_state(path, saved).ok());

  LoadOptions on_gpu;
  on_gpu.map_location = kGpu;
  for (const LoadOptions& options : {LoadOptions{}, on_gpu}) {
    const bool gpu = !options.map_location.is_cpu();
    SCOPED_TRACE(gpu ? "map_location cuda:0" : "default (CPU)");
    absl::StatusOr<c10::IValue> back = load_state(path, options);
    ASSERT_TRUE(back.ok()) << back.status();
    const Dict d = back->toGenericDict();
    for (const auto& kv : saved) {
      const at::Tensor want = kv.value().toTensor();
      const at::Tensor got = d.at(kv.key()).toTensor();
      const std::string& key = kv.key().toStringRef();
      EXPECT_EQ(got.device(), gpu ? kGpu : at::Device(at::kCPU)) << key;
      EXPECT_EQ(got.strides().vec(), want.strides().vec()) << key;
      EXPECT_EQ(got.storage_offset(), want.storage_offset()) << key;
      EXPECT_EQ(got.requires_grad(), want.requires_grad()) << key;
      EXPECT_TRUE(got.detach().cpu().equal(want.detach().cpu())) << key;
    }
    EXPECT_EQ(storage_of(d, "row"), storage_of(d, "base"));
    EXPECT_EQ(storage_of(d, "transposed"), storage_of(d, "base"));
    EXPECT_TRUE(d.at("again").toTensor().is_same(d.at("base").toTensor()));
    EXPECT_NE(storage_of(d, "mask"), storage_of(d, "base"));
  }
}

// This rank's part of an Adam-like state on the GPU: parameter `rank` only.
c10::IValue gpu_part(int rank) {
  Dict entry = str_dict();
  entry.insert("step", at::scalar_tensor(3.0, at::TensorOptions().device(kGpu)));
  entry.insert("exp_avg",
               at::arange(5000, at::TensorOptions().dtype(at::kFloat).device(kGpu)).add(rank));
  entry.insert("flags", at::arange(7, at::TensorOptions().device(kGpu)).remainder(2).to(at::kBool));
  const at::Tensor x = at::arange(4, at::TensorOptions().dtype(at::kFloat).device(kGpu)).add(rank);
  entry.insert(
      "z",
      at::complex(x, x.flip(0).add(1)).conj());  // complex (NCCL has no such type), conj bit set
  Dict state(c10::IntType::get(), c10::AnyType::get());
  state.insert(static_cast<int64_t>(rank), entry);
  Dict group = str_dict();
  group.insert("lr", 0.1);
  group.insert("params", c10::List<int64_t>({static_cast<int64_t>(rank)}));
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(group);
  Dict sd = str_dict();
  sd.insert("state", state);
  sd.insert("param_groups", groups);
  return sd;
}

void expect_consolidated(const c10::IValue& full, int world) {
  const Dict state = full.toGenericDict().at("state").toGenericDict();
  ASSERT_EQ(state.size(), static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const Dict want =
        gpu_part(r).toGenericDict().at("state").toGenericDict().at(int64_t{r}).toGenericDict();
    const Dict got = state.at(int64_t{r}).toGenericDict();
    for (const auto& kv : want) {
      const at::Tensor t = got.at(kv.key()).toTensor();
      EXPECT_TRUE(t.device().is_cpu()) << r << " " << kv.key().toStringRef();
      EXPECT_TRUE(t.equal(kv.value().toTensor().resolve_conj().cpu()))
          << r << " " << kv.key().toStringRef();
    }
  }
}

TEST(CheckpointGpuTest, ConsolidatesGpuStateOverNccl) {
  DTRAIN_GPU_TEST_OR_SKIP();
  comm::testing::run_ranks_as_threads(
      1,
      [](comm::Group& g) {
        ASSERT_TRUE(g.device().is_cuda()) << g.device();
        absl::StatusOr<c10::IValue> full = consolidate_state_dict(g, gpu_part(0), 0);
        ASSERT_TRUE(full.ok()) << full.status();
        expect_consolidated(*full, 1);
      },
      comm::testing::with_backend("nccl"));
}

// Gloo sends CPU memory only: GPU state goes through a copy of one chunk at a time on the CPU.
TEST(CheckpointGpuTest, ConsolidatesGpuStateOverGloo) {
  DTRAIN_GPU_TEST_OR_SKIP();
  comm::testing::run_ranks_as_threads(2, [](comm::Group& g) {
    ASSERT_TRUE(g.device().is_cpu()) << g.device();
    ConsolidateOptions o;
    o.chunk_bytes = 4096;  // several chunks for exp_avg
    absl::StatusOr<c10::IValue> full = consolidate_state_dict(g, gpu_part(g.rank()), 1, o);
    ASSERT_TRUE(full.ok()) << full.status();
    if (g.rank() == 1) expect_consolidated(*full, 2);
  });
}

TEST(CheckpointGpuTest, ShardedSaveOfGpuStateLoadsOntoTheGpu) {
  DTRAIN_GPU_TEST_OR_SKIP();
  const std::string dir = temp_dir();
  const at::Tensor weights = at::arange(40, at::TensorOptions().dtype(at::kFloat).device(kGpu));
  comm::testing::run_ranks_as_threads(2, [&](comm::Group& g) {
    ShardedState mine;
    ShardedState::Param p;
    p.shape = {40};
    p.range = {20 * g.rank(), 20 * (g.rank() + 1)};
    p.entries.insert("exp_avg",
                     weights.narrow(0, p.range.begin, 20));  // a view of a bigger GPU storage
    mine.params[0] = p;
    absl::Status s = save_sharded(g, dir, mine, "flat");
    ASSERT_TRUE(s.ok()) << s;
  });
  LoadOptions on_gpu;
  on_gpu.map_location = kGpu;
  absl::StatusOr<ShardedState> back = load_sharded(dir, {{0, {10, 30}}}, on_gpu);
  ASSERT_TRUE(back.ok()) << back.status();
  const at::Tensor got = back->params.at(0).entries.at("exp_avg").toTensor();
  EXPECT_EQ(got.device(), kGpu);
  EXPECT_TRUE(got.equal(weights.narrow(0, 10, 20)));
}

}  // namespace
}  // namespace dtrain::checkpoint
