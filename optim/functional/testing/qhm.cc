#include "optim/functional/testing/qhm.h"

#include "optim/functional/registry.h"

namespace dtrain::optim::testing {

void register_qhm() {
  auto& r = FunctionalRegistry::global();
  r.register_optimizer("QHM", [](std::vector<at::Tensor> params, const OptionsDict& options) {
    return std::unique_ptr<FunctionalOptimizer>(
        std::make_unique<FunctionalQHM>(std::move(params), options));
  });
  r.register_twin<TorchQHM>("QHM");
}

}  // namespace dtrain::optim::testing
