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
//
// Param groups are shared as in PyTorch (where the wrapper's param_groups *is* the local
// optimizer's list): a group added to either this optimizer or the local one reaches the other
// before the next step() or state_dict(). LibTorch's add_param_group is not virtual, so that is
// when it happens, not at the call.
#ifndef DTRAIN_OPTIM_POST_LOCAL_SGD_OPTIMIZER_H_
#define DTRAIN_OPTIM_POST_LOCAL_SGD_OPTIMIZER_H_

#include <memory>

#include <torch/optim/optimizer.h>

#include "optim/model_averagers.h"

namespace dtrain::optim {

class PostLocalSGDOptimizer : public torch::optim::Optimizer {
 public:
  PostLocalSGDOptimizer(std::unique_ptr<torch::optim::Optimizer> optim,
                        std::shared_ptr<ModelAverager> averager);

  // Local step, then averager.average_parameters over the local optimizer's parameters.
  at::Tensor step(LossClosure closure = nullptr) override;

  // The local optimizer's state dict in PyTorch's format, plus "step": the averager's step.
  c10::IValue state_dict();
  // Loads the local optimizer's state and restores the averager's step; without "step" it warns
  // and sets the step to 0, as PyTorch does.
  void load_state_dict(const c10::IValue& state_dict);

  // The local optimizer's per-parameter state, as PyTorch's PostLocalSGDOptimizer.state. LibTorch's
  // state() is not virtual: called through a torch::optim::Optimizer& it gives this object's own
  // map, which stays empty; call it on PostLocalSGDOptimizer or on optimizer().
  decltype(auto) state() { return optim_->state(); }

  torch::optim::Optimizer& optimizer() { return *optim_; }
  ModelAverager& averager() { return *averager_; }

 private:
  void sync_options(bool to_local);

  std::unique_ptr<torch::optim::Optimizer> optim_;
  std::shared_ptr<ModelAverager> averager_;
  size_t synced_;  // groups both sides had at the last sync_options
};

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_POST_LOCAL_SGD_OPTIMIZER_H_
