// Optimizer state per rank against world size: ZeroRedundancyOptimizer(Adam) measured, not
// computed, on a GPT-2-shaped parameter list (d=256, 12 layers, 50257-token embedding: 22.6M
// parameters, the embedding 57% of them), ranks as threads with their own Gloo groups.
//
//   ./bazelw run -c opt //bench:state_per_rank > state.dat     # bench/compare_pytorch does this
//
// One line per world size 1..8: world, unsharded MiB (one replica's Adam state), then the largest
// and smallest rank's MiB for sorted-greedy (PyTorch's partition) and for the flat partition,
// and the ideal (unsharded / world).
#include <cstdio>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>

#include "comm/test_harness.h"
#include "optim/functional_adapter.h"
#include "optim/zero_redundancy_optimizer.h"

namespace {

using namespace dtrain;  // NOLINT

std::vector<std::vector<int64_t>> gpt_shapes() {
  constexpr int64_t d = 256, vocab = 50257, context = 1024, layers = 12;
  std::vector<std::vector<int64_t>> s = {{vocab, d}, {context, d}};
  for (int64_t l = 0; l < layers; ++l) {
    for (auto shape : std::vector<std::vector<int64_t>>{{d}, {d}, {3 * d, d}, {3 * d}, {d, d}, {d}, {d}, {d},
                                                         {4 * d, d}, {4 * d}, {d, 4 * d}, {d}}) {
      s.push_back(shape);
    }
  }
  s.push_back({d});
  s.push_back({d});
  return s;
}

// Largest and smallest state bytes over the ranks of one run.
std::pair<int64_t, int64_t> measure(int world, optim::PartitionStrategy strategy) {
  std::vector<int64_t> bytes(world, 0);
  comm::testing::HarnessOptions ho;
  ho.timeout = std::chrono::minutes(5);
  comm::testing::run_ranks_as_threads(
      world,
      [&](comm::Group& g) {
        std::vector<at::Tensor> params;
        for (const auto& shape : gpt_shapes()) {
          at::Tensor p = at::zeros(shape).requires_grad_(true);
          p.mutable_grad() = at::zeros(shape);
          params.push_back(p);
        }
        optim::OptionsDict adam = optim::new_options_dict();
        adam.insert("lr", 1e-3);
        optim::ZeroOptions zo;
        zo.group = g;
        zo.strategy = strategy;
        zo.parameters_as_bucket_view = true;
        optim::ZeroRedundancyOptimizer zero(
            params, optim::local_optimizer<optim::FunctionalOptimizerAdapter>("Adam", adam), zo);
        zero.step();
        bytes[g.rank()] = zero.local_state_bytes();
      },
      ho);
  return {*std::max_element(bytes.begin(), bytes.end()), *std::min_element(bytes.begin(), bytes.end())};
}

}  // namespace

int main() {
  const double mib = 1 << 20;
  int64_t unsharded = 0;
  for (int world = 1; world <= 8; ++world) {
    const auto sg = measure(world, optim::PartitionStrategy::kSortedGreedy);
    const auto flat = measure(world, optim::PartitionStrategy::kFlat);
    if (world == 1) unsharded = sg.first;
    std::printf("%d %.2f %.2f %.2f %.2f %.2f %.2f\n", world, unsharded / mib, sg.first / mib, sg.second / mib,
                flat.first / mib, flat.second / mib, unsharded / mib / world);
    std::fflush(stdout);
  }
  return 0;
}
