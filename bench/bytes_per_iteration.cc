// Bytes each rank sends per training iteration, counted by comm's counting group (what each
// collective moves per rank in a bandwidth-optimal algorithm), for DDP alone, DDP +
// ZeroRedundancyOptimizer (ZeRO-1, PyTorch's) and DDP + ZeRO-2 (hook_with_zero2), next to the
// formulas, and the gradient bytes a rank keeps for the step. Model: ddp_hooks/testing/benchmark_mlp.h,
// 8 x Linear(1024, 1024) (8.4M parameters, 32 MiB), DDP's default 25 MiB buckets, Adam; ranks
// as threads with their own Gloo groups, world 2..8.
//
//   ./bazelw run -c opt //bench:bytes_per_iteration
//
// One line per world: world, model MiB, then per mode (ddp, zero1, zero2) the MiB sent per rank
// and the formula's MiB (2(n-1)/n, 3(n-1)/n and 2(n-1)/n of the model), then the gradient MiB
// a rank keeps after backward with ZeRO-1 and with ZeRO-2.
#include <cstdio>
#include <memory>
#include <mutex>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "comm/testing/counting_group.h"
#include "comm/testing/test_harness.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "ddp_hooks/testing/benchmark_mlp.h"
#include "ddp_hooks/zero_hook.h"
#include "optim/functional/adapter.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace {

using namespace dtrain;  // NOLINT

enum Mode { kDDP = 0, kZero1 = 1, kZero2 = 2 };

struct Result {
  int64_t sent = 0;        // bytes, rank 0, one iteration
  int64_t grad_bytes = 0;  // largest rank
};

Result measure(int world, Mode mode) {
  Result out;
  std::mutex mu;
  comm::testing::HarnessOptions ho;
  ho.timeout = std::chrono::minutes(5);
  comm::testing::run_ranks_as_threads(
      world,
      [&](comm::Group& plain) {
        auto counter = std::make_shared<comm::ByteCounter>();
        comm::Group g = comm::counting_group(plain, counter);
        auto mlp = ddp_hooks::benchmark_mlp();
        ddp_hooks::DDPOptions d;
        d.group = g;
        ddp_hooks::DistributedDataParallel ddp(mlp.ptr(), d);
        std::unique_ptr<optim::ZeroRedundancyOptimizer> zero;
        if (mode != kDDP) {
          optim::ZeroOptions zo;
          zo.group = g;
          zo.shard_gradients = mode == kZero2;
          zero = std::make_unique<optim::ZeroRedundancyOptimizer>(
              mlp->parameters(),
              optim::local_optimizer<optim::FunctionalOptimizerAdapter>("Adam", {{"lr", 1e-4}}),
              zo);
          if (mode == kZero2) ddp.register_comm_hook(ddp_hooks::hook_with_zero2(ddp, *zero));
        }
        const at::Tensor x = at::ones({2, 1024});
        counter->reset();
        ddp.forward([&] { return mlp->forward(x).sum(); }).backward();
        if (zero) zero->step();
        const int64_t sent = counter->total_bytes();
        std::lock_guard<std::mutex> lock(mu);
        if (g.rank() == 0) out.sent = sent;
        if (zero) out.grad_bytes = std::max(out.grad_bytes, zero->gradient_bytes());
      },
      ho);
  return out;
}

}  // namespace

int main() {
  const double mib = 1 << 20;
  int64_t model = 0;
  for (const auto& p : ddp_hooks::benchmark_mlp()->parameters())
    model += p.numel() * p.element_size();
  std::printf(
      "# world model_MiB ddp_sent ddp_formula zero1_sent zero1_formula zero2_sent zero2_formula "
      "zero1_grad_MiB zero2_grad_MiB\n");
  for (int world = 2; world <= 8; ++world) {
    const Result ddp = measure(world, kDDP), z1 = measure(world, kZero1),
                 z2 = measure(world, kZero2);
    const double f = static_cast<double>(world - 1) / world * model / mib;
    std::printf("%d %.2f %.2f %.2f %.2f %.2f %.2f %.2f %.2f %.2f\n", world, model / mib,
                ddp.sent / mib, 2 * f, z1.sent / mib, 3 * f, z2.sent / mib, 2 * f,
                z1.grad_bytes / mib, z2.grad_bytes / mib);
    std::fflush(stdout);
  }
  return 0;
}
