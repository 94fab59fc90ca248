// Optimizer state per rank against world size: ZeroRedundancyOptimizer(Adam) measured, not
// computed, on a GPT-2-shaped parameter list (d=256, 12 layers, 50257-token embedding: 22.6M
// parameters, the embedding 57% of them), ranks as threads with their own Gloo groups.
//
//   ./bazelw run -c opt //bench:state_per_rank > state.dat     # bench/compare_pytorch does this
//
// One line per world size 1..8: world, unsharded MiB (one replica's Adam state), then the largest
// and smallest rank's MiB for sorted-greedy (PyTorch's partition) and for the flat partition,
// and the ideal (unsharded / world). Then gradient memory per rank: with DDP + ZeRO-1 every rank
// keeps every gradient (the model's size); with ZeRO-2 (DDP's default 25 MiB buckets,
// hook_with_zero2) the largest rank's gradient slices after backward, measured, and the bound on
// gradient buffers in flight during backward (the hook keeps at most two buckets' buffers, each
// padded and, while its all-to-all runs, with a receive buffer of the same size: 2 x the two
// largest padded buckets; the parameters' own .grad until copied into a bucket comes on top),
// and ZeRO-2's largest Adam state.
#include <algorithm>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "comm/testing/test_harness.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "ddp_hooks/zero_hook.h"
#include "optim/functional/adapter.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace {

using namespace dtrain;  // NOLINT

std::vector<std::vector<int64_t>> gpt_shapes() {
  constexpr int64_t d = 256, vocab = 50257, context = 1024, layers = 12;
  std::vector<std::vector<int64_t>> s = {{vocab, d}, {context, d}};
  for (int64_t l = 0; l < layers; ++l) {
    for (auto shape : std::vector<std::vector<int64_t>>{{d},
                                                        {d},
                                                        {3 * d, d},
                                                        {3 * d},
                                                        {d, d},
                                                        {d},
                                                        {d},
                                                        {d},
                                                        {4 * d, d},
                                                        {4 * d},
                                                        {d, 4 * d},
                                                        {d}}) {
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
        optim::ZeroOptions zo;
        zo.group = g;
        zo.strategy = strategy;
        zo.parameters_as_bucket_view = true;
        optim::ZeroRedundancyOptimizer zero(
            params,
            optim::local_optimizer<optim::FunctionalOptimizerAdapter>("Adam", {{"lr", 1e-3}}), zo);
        zero.step();
        bytes[g.rank()] = zero.local_state_bytes();
      },
      ho);
  return {*std::max_element(bytes.begin(), bytes.end()),
          *std::min_element(bytes.begin(), bytes.end())};
}

struct Zero2Bytes {
  int64_t grad_max = 0, state_max = 0, in_flight = 0;
};

// DDP + ZeRO-2 over a module holding the GPT-2-shaped parameters, one backward and step.
Zero2Bytes measure_zero2(int world) {
  Zero2Bytes out;
  std::mutex mu;
  comm::testing::HarnessOptions ho;
  ho.timeout = std::chrono::minutes(5);
  comm::testing::run_ranks_as_threads(
      world,
      [&](comm::Group& g) {
        auto module = std::make_shared<torch::nn::Module>();
        int k = 0;
        for (const auto& shape : gpt_shapes()) {
          module->register_parameter("p" + std::to_string(k++), at::zeros(shape));
        }
        ddp_hooks::DDPOptions d;
        d.group = g;
        ddp_hooks::DistributedDataParallel ddp(module, d);
        optim::ZeroOptions zo;
        zo.group = g;
        zo.shard_gradients = true;
        optim::ZeroRedundancyOptimizer zero(
            module->parameters(),
            optim::local_optimizer<optim::FunctionalOptimizerAdapter>("Adam", {{"lr", 1e-3}}), zo);
        ddp.register_comm_hook(ddp_hooks::hook_with_zero2(ddp, zero));
        at::Tensor loss = ddp.forward([&] {
          at::Tensor sum = at::zeros({});
          for (const auto& p : module->parameters()) sum = sum + p.sum();
          return sum;
        });
        loss.backward();
        zero.step();
        std::vector<int64_t> buckets;
        for (const auto& b : ddp.bucket_indices()) {
          int64_t numel = 0;
          for (size_t i : b) numel += ddp.parameters()[i].numel();
          buckets.push_back(((numel + world - 1) / world + 15) / 16 * 16 * world * 4);
        }
        std::sort(buckets.rbegin(), buckets.rend());
        std::lock_guard<std::mutex> lock(mu);
        out.grad_max = std::max(out.grad_max, zero.gradient_bytes());
        out.state_max = std::max(out.state_max, zero.local_state_bytes());
        out.in_flight = 2 * (buckets[0] + (buckets.size() > 1 ? buckets[1] : 0));
      },
      ho);
  return out;
}

}  // namespace

int main() {
  const double mib = 1 << 20;
  int64_t unsharded = 0;
  for (int world = 1; world <= 8; ++world) {
    const auto sg = measure(world, optim::PartitionStrategy::kSortedGreedy);
    const auto flat = measure(world, optim::PartitionStrategy::kFlat);
    if (world == 1) unsharded = sg.first;
    const Zero2Bytes z2 = measure_zero2(world);
    std::printf("%d %.2f %.2f %.2f %.2f %.2f %.2f %.2f %.2f %.2f %.2f\n", world, unsharded / mib,
                sg.first / mib, sg.second / mib, flat.first / mib, flat.second / mib,
                unsharded / mib / world, unsharded / 2 / mib, z2.grad_max / mib, z2.in_flight / mib,
                z2.state_max / mib);
    std::fflush(stdout);
  }
  return 0;
}
