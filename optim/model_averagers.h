// Model averagers (torch.distributed.algorithms.model_averaging): periodically replace every
// rank's parameters with their average over a group. Used by PostLocalSGDOptimizer.
//
//   dtrain::optim::PeriodicModelAverager averager(/*period=*/4, /*warmup_steps=*/100, world);
//   for (...) { optimizer.step(); averager.average_parameters(model->parameters()); }
//
//   // Every 2 steps within pairs of ranks, every 8 steps across all 8 ranks:
//   dtrain::optim::HierarchicalModelAverager h({{2, 2}, {8, 8}}, /*warmup_steps=*/0, world);
//
// average_parameters is a collective over the group used at that step (every rank calls it at
// every step, so the step counters agree). Only parameters that have a gradient are averaged
// (PyTorch's get_params_to_average); they are packed into one buffer, reduced with one
// all-reduce, and copied back in their own dtypes.
#ifndef DTRAIN_OPTIM_MODEL_AVERAGERS_H_
#define DTRAIN_OPTIM_MODEL_AVERAGERS_H_

#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "comm/process_group.h"

namespace dtrain::optim {

class ModelAverager {
 public:
  explicit ModelAverager(comm::Group group);
  virtual ~ModelAverager() = default;

  // Averages (when this step calls for it) and advances the step counter.
  virtual void average_parameters(const std::vector<at::Tensor>& params) = 0;
  void average_parameters(const std::vector<torch::optim::OptimizerParamGroup>& groups);

  int64_t step() const { return step_; }
  void set_step(int64_t step) { step_ = step; }
  const comm::Group& group() const { return group_; }

 protected:
  comm::Group group_;
  int64_t step_ = 0;
};

// PyTorch's utils.average_parameters: the parameters with gradients, averaged over `group` with
// one all-reduce. Ranks outside the group leave their parameters alone.
void average_parameters(const std::vector<at::Tensor>& params, const comm::Group& group);

// Averages every `period` steps after `warmup_steps` (at step warmup, warmup + period, ...).
// TORCH_CHECK: period >= 1 ("Arg ``period`` must be a positive value."), warmup_steps >= 0.
class PeriodicModelAverager : public ModelAverager {
 public:
  PeriodicModelAverager(int64_t period, int64_t warmup_steps, comm::Group group);
  using ModelAverager::average_parameters;
  void average_parameters(const std::vector<at::Tensor>& params) override;
  int64_t period() const { return period_; }
  int64_t warmup_steps() const { return warmup_steps_; }

 private:
  int64_t period_;
  int64_t warmup_steps_;
};

// (period, group size) levels with increasing periods and group sizes, the last group size
// equal to the group's size: at a step, the level with the largest period dividing it averages
// within consecutive subgroups of its size. Constructing it is a collective (it creates the
// subgroups). TORCH_CHECK with PyTorch's messages on an empty map, a non-positive first period,
// a last size other than the group size; also on unsorted levels or sizes not dividing the group.
class HierarchicalModelAverager : public ModelAverager {
 public:
  HierarchicalModelAverager(std::vector<std::pair<int64_t, int>> period_group_size,
                            int64_t warmup_steps, comm::Group group);
  using ModelAverager::average_parameters;
  void average_parameters(const std::vector<at::Tensor>& params) override;

 private:
  std::vector<int64_t> periods_;
  std::vector<comm::Group> groups_;  // this rank's group per level
  int64_t warmup_steps_;
};

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_MODEL_AVERAGERS_H_
