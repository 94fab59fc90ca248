// ./bazelw run -c opt //optim/functional:quant8_block_benchmark
// One thread decoding and encoding 8-bit blocks (internal/quant8_block.h) of 16M elements in each
// build this CPU runs: the two parts an 8-bit optimizer step adds to the float update. As in the
// kernel, the codes stream through memory and the floats stay in a cache-resident block buffer
// (decode: one block; encode: 64 blocks' values, cycled). Counters:
//   ns_per_elem      time per element
// BM_Decode/BM_Encode: Quant8Block<isa> over every block (isa 0 baseline, 1 AVX2 gathers, 2
// AVX-512: VBMI byte look-ups where the CPU has them). BM_Decode/3 is the AVX-512 build's VBMI
// decode called directly. Rows for a build the CPU lacks are skipped with a message.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include "optim/functional/internal/quant8_block.h"

namespace dtrain::optim::internal {
namespace {

constexpr int64_t kElements = int64_t{16} << 20;

struct Blocks {
  Blocks() : values(kElements), codes(kElements), scales(kElements / kQuantBlock) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    for (float& x : values) x = normal(rng) * 1e-3f;
    const Encoder8& enc = Encoder8::get(true);
    for (int64_t b = 0; b < kElements / kQuantBlock; ++b) {
      scales[b] = Quant8Block<KernelIsa::kBaseline>::encode(&values[b * kQuantBlock], kQuantBlock,
                                                            enc, &codes[b * kQuantBlock]);
    }
  }
  std::vector<float> values;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};
Blocks& blocks() {
  static Blocks* b = new Blocks();
  return *b;
}

bool runs(benchmark::State& state, int isa) {
  if (isa == 3 ? cpu_kernel_isa() >= KernelIsa::kAvx512 && cpu_has_vbmi()
               : static_cast<int>(cpu_kernel_isa()) >= isa) {
    return true;
  }
  state.SkipWithError("this CPU does not run that build");
  return false;
}

constexpr int64_t kResidentBlocks = 64;

template <KernelIsa kIsa>
void decode_all(Blocks& b, float* out) {
  const Encoder8& enc = Encoder8::get(true);
  for (int64_t k = 0; k < kElements; k += kQuantBlock) {
    Quant8Block<kIsa>::decode(&b.codes[k], kQuantBlock, enc, b.scales[k / kQuantBlock], out);
    benchmark::ClobberMemory();
  }
}

void BM_Decode(benchmark::State& state) {
  const int isa = static_cast<int>(state.range(0));
  if (!runs(state, isa)) return;
  Blocks& b = blocks();
  alignas(64) float out[kQuantBlock];
  const Encoder8& enc = Encoder8::get(true);
  for (auto _ : state) {
    switch (isa) {
      case 0:
        decode_all<KernelIsa::kBaseline>(b, out);
        break;
      case 1:
        decode_all<KernelIsa::kAvx2>(b, out);
        break;
      case 2:
        decode_all<KernelIsa::kAvx512>(b, out);
        break;
      default:
        for (int64_t k = 0; k < kElements; k += kQuantBlock) {
          Quant8Block<KernelIsa::kAvx512>::decode_vbmi(&b.codes[k], enc, b.scales[k / kQuantBlock],
                                                       out);
          benchmark::ClobberMemory();
        }
    }
    benchmark::DoNotOptimize(out);
  }
  state.counters["ns_per_elem"] = benchmark::Counter(
      static_cast<double>(kElements) * 1e-9,
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_Decode)->ArgName("isa")->DenseRange(0, 3)->UseRealTime();

template <KernelIsa kIsa>
void encode_all(Blocks& b, std::vector<uint8_t>& out) {
  const Encoder8& enc = Encoder8::get(true);
  for (int64_t k = 0; k < kElements; k += kQuantBlock) {
    const float* values = &b.values[(k / kQuantBlock) % kResidentBlocks * kQuantBlock];
    b.scales[k / kQuantBlock] = Quant8Block<kIsa>::encode(values, kQuantBlock, enc, &out[k]);
  }
}

void BM_Encode(benchmark::State& state) {
  const int isa = static_cast<int>(state.range(0));
  if (!runs(state, isa)) return;
  Blocks& b = blocks();
  std::vector<uint8_t> out(kElements);
  for (auto _ : state) {
    if (isa == 0) encode_all<KernelIsa::kBaseline>(b, out);
    if (isa == 1) encode_all<KernelIsa::kAvx2>(b, out);
    if (isa == 2) encode_all<KernelIsa::kAvx512>(b, out);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["ns_per_elem"] = benchmark::Counter(
      static_cast<double>(kElements) * 1e-9,
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_Encode)->ArgName("isa")->DenseRange(0, 2)->UseRealTime();

}  // namespace
}  // namespace dtrain::optim::internal

BENCHMARK_MAIN();
