// PostLocalSGDOptimizer (torch.distributed.optim.PostLocalSGDOptimizer): runs the local
// optimizer at every step and then lets a model averager average the parameters (after its
// warm-up, every `period` steps). Itself a torch::optim::Optimizer.
//
//   auto local = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.01));
//   auto averager = std::make_shared<dtrain::optim::PeriodicModelAverager>(4, 100, world);
//   dtrain::optim::PostLocalSGDOptimizer opt(std::move(local), averager);
//   for (...) { opt.zero_grad(); loss.backward(); opt.step(); }
//   c10::IValue sd = opt.state_dict();      // the local optimizer's, plus "step" of the averager
//
// step() is a collective whenever the averager averages (every rank must step).
#ifndef DTRAIN_OPTIM_POST_LOCAL_SGD_OPTIMIZER_H_
#define DTRAIN_OPTIM_POST_LOCAL_SGD_OPTIMIZER_H_

#include <memory>

#include <torch/optim/optimizer.h>

#include "optim/model_averagers.h"

namespace dtrain::optim {

class PostLocalSGDOptimizer : public torch::optim::Optimizer {
 public:
  PostLocalSGDOptimizer(std::unique_ptr<torch::optim::Optimizer> optim, std::shared_ptr<ModelAverager> averager);

  // Local step, then averager.average_parameters over the local optimizer's parameters.
  at::Tensor step(LossClosure closure = nullptr) override;

  // The local optimizer's state dict in PyTorch's format, plus "step": the averager's step.
  c10::IValue state_dict();
  // Loads the local optimizer's state and restores the averager's step; without "step" it warns
  // and sets the step to 0, as PyTorch does.
  void load_state_dict(const c10::IValue& state_dict);

  torch::optim::Optimizer& optimizer() { return *optim_; }
  ModelAverager& averager() { return *averager_; }

 private:
  void sync_options(bool to_local);

  std::unique_ptr<torch::optim::Optimizer> optim_;
  std::shared_ptr<ModelAverager> averager_;
};

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_POST_LOCAL_SGD_OPTIMIZER_H_
