// A program outside dtrain's workspace, built against @dtrain as a Bazel module: one rank, one
// ZeroRedundancyOptimizer(Adam) step on a 4x3 parameter. Prints the parameter's change and exits
// 0 when the step moved it as Adam's first step does (every element by lr). Its message is
// formatted with the consumer's own Abseil (@abseil-cpp), the one dtrain links too.
#include <cmath>
#include <cstdio>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "absl/strings/str_format.h"
#include "comm/process_group.h"
#include "optim/zero/zero_redundancy_optimizer.h"

int main() {
  dtrain::comm::InitOptions init;
  init.store = c10::make_intrusive<c10d::HashStore>();
  init.rank = 0;
  init.world_size = 1;
  absl::StatusOr<dtrain::comm::Group> world = dtrain::comm::init_process_group(init);
  if (!world.ok()) {
    std::fprintf(stderr, "zero_step: %s\n", world.status().ToString().c_str());
    return 1;
  }
  at::Tensor p = at::ones({4, 3}).set_requires_grad(true);
  dtrain::optim::ZeroOptions options;
  options.group = *world;
  dtrain::optim::ZeroRedundancyOptimizer opt(
      std::vector<at::Tensor>{p},
      dtrain::optim::local_optimizer<dtrain::optim::FunctionalOptimizerAdapter>("Adam",
                                                                                {{"lr", 0.1}}),
      options);
  p.mutable_grad() = at::full({4, 3}, 2.0);
  opt.step();
  const double change = (at::ones({4, 3}) - p.detach()).abs().max().item<double>();
  absl::PrintF(
      "dtrain as a module: ZeRO(Adam) moved the parameter by %.6f (Adam's first step: lr = 0.1)\n",
      change);
  return std::abs(change - 0.1) < 1e-5 ? 0 : 1;
}
