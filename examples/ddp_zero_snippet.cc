// The README's "DDP + ZeRO around your LibTorch model" snippet, compiled so it stays true.
// Run it under a launcher: ./bazelw run //launcher:launch -- --nproc_per_node=2 -- examples/ddp_zero_snippet
#include <cstdio>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "comm/process_group.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "optim/zero/zero_redundancy_optimizer.h"

int main() {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int i = 0; i < 20; ++i) batches.emplace_back(torch::randn({8, 512}), torch::randn({8, 10}));

  // --- README snippet, from here ---
  using namespace dtrain;
  comm::Group world =
      *comm::init_process_group({});  // env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  auto model = torch::nn::Sequential(torch::nn::Linear(512, 512), torch::nn::ReLU(),
                                     torch::nn::Linear(512, 10));

  ddp_hooks::DDPOptions ddp_options;
  ddp_options.group = world;
  ddp_options.gradient_as_bucket_view = true;
  ddp_hooks::DistributedDataParallel ddp(model.ptr(), ddp_options);  // broadcasts rank 0's weights
  ddp.register_comm_hook(
      std::make_unique<ddp_hooks::CompressHook>(world, at::kHalf));  // optional: fp16

  optim::ZeroOptions zero_options;
  zero_options.group = world;
  optim::ZeroRedundancyOptimizer opt(
      model->parameters(),
      optim::local_optimizer<optim::FunctionalOptimizerAdapter>("Adam", {{"lr", 1e-3}}),
      zero_options);

  for (auto& [x, y] : batches) {
    opt.zero_grad();
    ddp.forward([&] { return torch::mse_loss(model->forward(x), y); })
        .backward();  // grads averaged
    opt.step();       // this rank's shard of Adam, then parameter sync
  }
  // --- to here ---
  std::printf("rank %d: trained %zu batches\n", world.rank(), batches.size());
  return 0;
}
