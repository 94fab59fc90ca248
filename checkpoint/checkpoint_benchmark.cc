// ./bazelw run -c opt //checkpoint:checkpoint_benchmark
// 160 MiB of Adam state (20M fp32 parameters in 20 tensors: exp_avg + exp_avg_sq), world 2 as
// two benchmark threads with their own Gloo groups:
//   BM_Consolidate     consolidate_state_dict of the two halves onto rank 0
//   BM_RawGather       a c10d gather of the same bytes (each rank's half as one buffer)
//   BM_SaveSingleFile  save_state of the whole 160 MiB (atomic write + fsync + checksum)
//   BM_LoadSingleFile  load_state of it (read + checksum + decode)
//   BM_SaveSharded     save_sharded at world 2 (each rank writes its 80 MiB, then the metadata)
//   BM_PlainWrite      write() + fsync of 160 MiB of bytes: the floor for the saves
//   BM_LoadPythonWritten  load_state of a 160 MiB Adam state dict Python's torch.save wrote
//                      (bench/peers/checkpoint_pytorch.py, run once with the installed PyTorch)
//   BM_VerifyEntries   the zip walk + every entry's CRC-32 of that file (the verification cost)
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include "checkpoint/consolidation.h"
#include "checkpoint/optimizer_state_dict.h"
#include "checkpoint/sharded.h"
#include "checkpoint/state_file.h"
#include "checkpoint/stored_zip.h"
#include "comm/testing/thread_world.h"
#include "torch/version.h"

namespace dtrain::checkpoint {
namespace {

constexpr int kWorld = 2;
constexpr int kTensors = 20;
constexpr int64_t kPerTensor = int64_t{1} << 20;                     // 20M parameters in all
constexpr int64_t kStateBytes = int64_t{kTensors} * kPerTensor * 8;  // exp_avg + exp_avg_sq

using Dict = c10::impl::GenericDict;

// Wall milliseconds since `start`. Threaded rows report it per rank in an "ms" counter: the Time
// column of a threaded benchmark divides by the iterations of both threads.
double elapsed_ms(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// Parameters i with i % world == rank, as an optimizer's local state dict.
c10::IValue local_state(int rank, int world) {
  OptimizerStateDict sd;
  ParamGroup group;
  for (int64_t i = rank; i < kTensors; i += world) {
    StateEntry e = new_state_entry();
    e.insert("step", at::scalar_tensor(10.0, at::kFloat));
    e.insert("exp_avg", at::randn({kPerTensor}));
    e.insert("exp_avg_sq", at::rand({kPerTensor}));
    sd.state.emplace(i, e);
    group.params.push_back(i);
  }
  group.options.insert("lr", 1e-3);
  sd.param_groups.push_back(std::move(group));
  return to_ivalue(sd);
}

void BM_Consolidate(benchmark::State& state) {
  comm::Group& g = comm::thread_world_rank(state.thread_index(), kWorld);
  const c10::IValue mine = local_state(g.rank(), kWorld);
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    auto full = consolidate_state_dict(g, mine, 0);
    if (!full.ok()) state.SkipWithError(std::string(full.status().message()).c_str());
  }
  state.counters["ms"] = elapsed_ms(start) / state.iterations() / kWorld;
  state.counters["state_MiB"] =
      static_cast<double>(kStateBytes) / (1 << 20) / kWorld;  // summed over 2 threads
  state.counters["GiBps"] =
      benchmark::Counter(static_cast<double>(kStateBytes) * state.iterations() / kWorld,
                         benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
}
BENCHMARK(BM_Consolidate)->Threads(kWorld)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_RawGather(benchmark::State& state) {
  comm::Group& g = comm::thread_world_rank(state.thread_index(), kWorld);
  const int64_t half = kStateBytes / kWorld / 4;  // floats per rank
  std::vector<at::Tensor> in = {at::randn({half})};
  std::vector<std::vector<at::Tensor>> out;
  if (g.rank() == 0) out = {{at::empty({half}), at::empty({half})}};
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) g->gather(out, in)->wait();
  state.counters["ms"] = elapsed_ms(start) / state.iterations() / kWorld;
  state.counters["GiBps"] =
      benchmark::Counter(static_cast<double>(kStateBytes) * state.iterations() / kWorld,
                         benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
}
BENCHMARK(BM_RawGather)->Threads(kWorld)->UseRealTime()->Unit(benchmark::kMillisecond);

std::string bench_dir() {
  static const std::string dir = [] {
    char d[] = "/tmp/dtrain_ckpt_bench_XXXXXX";
    TORCH_CHECK(::mkdtemp(d) != nullptr);
    return std::string(d);
  }();
  return dir;
}

c10::IValue whole_state() {
  static const c10::IValue v = [] {
    // Both halves in one dict, as rank 0 has it after consolidation.
    Dict sd = local_state(0, 1).toGenericDict();
    return c10::IValue(sd);
  }();
  return v;
}

void BM_SaveSingleFile(benchmark::State& state) {
  const std::string path = bench_dir() + "/single.pt";
  for (auto _ : state) {
    absl::Status s = save_state(path, whole_state());
    if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
  }
  state.SetBytesProcessed(state.iterations() * kStateBytes);
}
BENCHMARK(BM_SaveSingleFile)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_LoadSingleFile(benchmark::State& state) {
  const std::string path = bench_dir() + "/single.pt";
  if (!save_state(path, whole_state()).ok()) state.SkipWithError("save failed");
  for (auto _ : state) {
    auto v = load_state(path);
    if (!v.ok()) state.SkipWithError(std::string(v.status().message()).c_str());
  }
  state.SetBytesProcessed(state.iterations() * kStateBytes);
}
BENCHMARK(BM_LoadSingleFile)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_SaveSharded(benchmark::State& state) {
  comm::Group& g = comm::thread_world_rank(state.thread_index(), kWorld);
  ShardedState mine;
  for (int64_t i = g.rank(); i < kTensors; i += kWorld) {
    ShardedState::Param p;
    p.shape = {kPerTensor};
    p.range = {0, kPerTensor};
    p.entries.insert("exp_avg", at::randn({kPerTensor}));
    p.entries.insert("exp_avg_sq", at::rand({kPerTensor}));
    mine.params[i] = p;
  }
  const std::string dir = bench_dir();
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    absl::Status s = save_sharded(g, dir, mine, "sorted_greedy");
    if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
  }
  state.counters["ms"] = elapsed_ms(start) / state.iterations() / kWorld;
  state.SetBytesProcessed(state.iterations() * kStateBytes / kWorld);  // summed over the threads
}
BENCHMARK(BM_SaveSharded)->Threads(kWorld)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_PlainWrite(benchmark::State& state) {
  std::vector<char> bytes(static_cast<size_t>(kStateBytes), 1);
  const std::string path = bench_dir() + "/plain.bin";
  for (auto _ : state) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    for (size_t off = 0; off < bytes.size();) {
      const ssize_t n =
          ::write(fd, bytes.data() + off, std::min<size_t>(8 << 20, bytes.size() - off));
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    ::fsync(fd);
    ::close(fd);
  }
  state.SetBytesProcessed(state.iterations() * kStateBytes);
}
BENCHMARK(BM_PlainWrite)->UseRealTime()->Unit(benchmark::kMillisecond);

// The Python-written file, made once per PyTorch version (the Python beside this LibTorch).
std::string python_file() {
  const std::string path = bench_dir() + "/python_adam_" + TORCH_VERSION + ".pt";
  if (!std::filesystem::exists(path)) {
    const std::string cmd = "/usr/bin/python3 bench/peers/checkpoint_pytorch.py write " + path;
    if (std::system(cmd.c_str()) != 0) return "";
  }
  return path;
}

void BM_LoadPythonWritten(benchmark::State& state) {
  const std::string path = python_file();
  if (path.empty()) {
    state.SkipWithError(
        "could not write the Python file (run from the repository root, with PyTorch installed)");
    return;
  }
  // One untimed load first, as the Python peer does: without it a run of one iteration (a
  // 160 MiB load passes the default minimum time alone) times only the process's first load,
  // whose fresh memory costs several times a later one's, against Python's warm mean.
  if (!load_state(path).ok()) {
    state.SkipWithError("the warm-up load failed");
    return;
  }
  for (auto _ : state) {
    auto v = load_state(path);
    if (!v.ok()) state.SkipWithError(std::string(v.status().message()).c_str());
  }
  state.SetBytesProcessed(state.iterations() *
                          static_cast<int64_t>(std::filesystem::file_size(path)));
}
BENCHMARK(BM_LoadPythonWritten)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_VerifyEntries(benchmark::State& state) {
  const std::string path = python_file();
  if (path.empty()) {
    state.SkipWithError("could not write the Python file");
    return;
  }
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (auto _ : state) {
    auto zip = read_stored_zip(bytes, path, /*verify_crcs=*/true);
    if (!zip.ok()) state.SkipWithError(std::string(zip.status().message()).c_str());
    benchmark::DoNotOptimize(zip);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes.size()));
}
BENCHMARK(BM_VerifyEntries)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace dtrain::checkpoint

BENCHMARK_MAIN();
