// PostLocalSGDOptimizer and DiLoCo refuse a wrapped optimizer with param_remainders (bfloat16
// parameters whose int16 remainders hold float32 masters; optim/functional/adam.h): both write new
// values into the bfloat16 parameters that no remainder was split from. Refused at construction
// (also through a ZeroRedundancyOptimizer inside), and at a step when a group added since asks for
// it, before anything changes. Ranks as threads, world size 1.
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"
#include "optim/diloco.h"
#include "optim/functional/adapter.h"
#include "optim/functional/state_precision.h"
#include "optim/model_averagers.h"
#include "optim/post_local_sgd_optimizer.h"
#include "optim/zero/zero_redundancy_optimizer.h"
#include "testing/test_util.h"

namespace dtrain::optim {
namespace {

using comm::testing::run_ranks_as_threads;
using test_util::expect_error;

std::vector<at::Tensor> bf16_params() {
  return {at::cos(at::arange(30, at::kFloat)).to(at::kBFloat16).requires_grad_(),
          at::sin(at::arange(12, at::kFloat)).view({3, 4}).to(at::kBFloat16).requires_grad_()};
}

OptionsDict adamw(bool remainders) {
  OptionsDict o = new_options_dict();
  o.insert("lr", 0.01);
  if (remainders) o.insert(kParamRemaindersKey, true);
  o.insert(kStateDtypeKey, std::string(kStateBFloat16));
  return o;
}

std::unique_ptr<torch::optim::Optimizer> inner(std::vector<at::Tensor> p, bool remainders) {
  return std::make_unique<FunctionalOptimizerAdapter>(std::move(p), "AdamW", adamw(remainders));
}

std::shared_ptr<PeriodicModelAverager> averager(comm::Group& g) {
  return std::make_shared<PeriodicModelAverager>(/*period=*/1, /*warmup_steps=*/0, g);
}

DiLoCoOptions diloco_options(comm::Group& g) {
  DiLoCoOptions o;
  o.group = g;
  o.sync_every = 2;
  return o;
}

constexpr char kWhy[] =
    "its bfloat16 parameters and int16 remainders hold float32 master weights, but ";
constexpr char kWhatToDo[] =
    "give the wrapped optimizer param_remainders=False (float32 parameters with "
    "state_dtype='bfloat16' or '8bit' keep its state small)";

TEST(WrappedParamRemaindersTest, PostLocalSGDRefusesThem) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    expect_error([&] { PostLocalSGDOptimizer(inner(bf16_params(), true), averager(g)); },
                 "PostLocalSGDOptimizer: the wrapped optimizer keeps param_remainders=True (its "
                 "defaults)");
    expect_error([&] { PostLocalSGDOptimizer(inner(bf16_params(), true), averager(g)); },
                 std::string(kWhy) + "PostLocalSGDOptimizer writes the model averager's averages");
    expect_error([&] { PostLocalSGDOptimizer(inner(bf16_params(), true), averager(g)); },
                 kWhatToDo);
    // A checkpoint whose param group asks for it (an unsharded AdamW with remainders saved it)
    // is refused at the next step, before the local step changes anything.
    std::vector<at::Tensor> saved_params = bf16_params();
    FunctionalOptimizerAdapter saver(saved_params, "AdamW", adamw(true));
    for (auto& p : saved_params) p.mutable_grad() = at::ones_like(p);
    saver.step();
    std::vector<at::Tensor> p = bf16_params();
    for (auto& t : p) t.mutable_grad() = at::ones_like(t);
    PostLocalSGDOptimizer opt(inner(p, false), averager(g));
    opt.load_state_dict(saver.state_dict());
    expect_error([&] { opt.step(); }, "keeps param_remainders=True (param group 0)");
    for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(at::equal(p[i], bf16_params()[i])) << i;
  });
}

TEST(WrappedParamRemaindersTest, DiLoCoRefusesThemAlsoThroughZero) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    expect_error([&] { DiLoCo(inner(bf16_params(), true), diloco_options(g)); },
                 std::string("DiLoCo: the wrapped optimizer keeps param_remainders=True (its "
                             "defaults): ") +
                     kWhy + "DiLoCo copies the outer step's global parameters");
    expect_error([&] { DiLoCo(inner(bf16_params(), true), diloco_options(g)); }, kWhatToDo);
    // ZeRO within the replica, its local AdamW with remainders.
    ZeroOptions zo;
    zo.group = g;
    auto zero = std::make_unique<ZeroRedundancyOptimizer>(
        bf16_params(), local_optimizer<FunctionalOptimizerAdapter>("AdamW", adamw(true)), zo);
    expect_error([&] { DiLoCo(std::move(zero), diloco_options(g)); },
                 "DiLoCo: the wrapped optimizer keeps param_remainders=True");
    DiLoCo without(inner(bf16_params(), false), diloco_options(g));  // accepted
  });
}

}  // namespace
}  // namespace dtrain::optim
