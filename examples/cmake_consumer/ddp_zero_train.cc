// Trains a small MLP for 50 steps with DistributedDataParallel (the bf16 compression hook) and
// ZeroRedundancyOptimizer(Adam), on one rank with an in-process store, linking only what
// find_package(dtrain) exports. Exits 0 when the loss fell by more than 4x.
#include <cstdio>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/process_group.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "optim/zero/zero_redundancy_optimizer.h"

using namespace dtrain;

int main() {
  comm::InitOptions init;
  init.store = c10::make_intrusive<c10d::HashStore>();
  init.rank = 0;
  init.world_size = 1;
  absl::StatusOr<comm::Group> world = comm::init_process_group(init);
  if (!world.ok()) {
    std::fprintf(stderr, "ddp_zero_train: %s\n", world.status().ToString().c_str());
    return 1;
  }
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(16, 32), torch::nn::ReLU(),
                              torch::nn::Linear(32, 4));
  const at::Tensor teacher = torch::randn({16, 4});

  ddp_hooks::DDPOptions ddp_options;
  ddp_options.group = *world;
  ddp_hooks::DistributedDataParallel ddp(model.ptr(), ddp_options);
  ddp.register_comm_hook(std::make_unique<ddp_hooks::CompressHook>(*world, at::kBFloat16));

  optim::ZeroOptions zero_options;
  zero_options.group = *world;
  optim::ZeroRedundancyOptimizer opt(
      model->parameters(),
      optim::local_optimizer<optim::FunctionalOptimizerAdapter>("Adam", {{"lr", 1e-2}}),
      zero_options);

  double first = 0, last = 0;
  for (int step = 1; step <= 50; ++step) {
    const at::Tensor x = torch::randn({64, 16});
    const at::Tensor y = x.matmul(teacher);
    opt.zero_grad();
    at::Tensor loss = ddp.forward([&] { return torch::mse_loss(model->forward(x), y); });
    loss.backward();
    opt.step();
    last = loss.item<double>();
    if (step == 1) first = last;
  }
  std::printf("dtrain from CMake: DDP(bf16 hook) + ZeRO(Adam), loss %.6f -> %.6f in 50 steps\n",
              first, last);
  return last < first / 4 ? 0 : 1;
}
