// The CUDA path of Adam, AdamW, SGD and Adagrad: ATen's fused multi-tensor kernels (or, for
// Adagrad on a LibTorch without its CUDA kernel, the _foreach_ ops), one call per (device, dtype).
// 20 steps on CUDA against the same steps through dtrain's CPU path and through LibTorch's own
// torch::optim on CUDA; that the fused path really ran; the state it keeps (a float32 step on the
// device, PyTorch's layout in state_dict) and continuing from a loaded state.
// Without a GPU every test skips, saying so; with DTRAIN_REQUIRE_GPU=1 (the GPU CI) it fails.
#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "comm/testing/gpu_testing.h"
#include "optim/functional/internal/fused.h"
#include "optim/functional/libtorch_compat.h"
#include "optim/functional/optimizers.h"

namespace dtrain::optim {
namespace {

constexpr int kSteps = 20;

class FunctionalCudaTest : public ::testing::Test {
 protected:
  void SetUp() override { DTRAIN_GPU_TEST_OR_SKIP(); }
};

// A few tensors: odd sizes (the kernels' vector tails), a 0-dim-like {1}, one over 65536 elements
// (more than one chunk of ATen's multi_tensor_apply).
const std::vector<std::vector<int64_t>> kShapes = {{37}, {8, 33}, {3, 4, 5}, {1}, {70001}};

struct Problem {
  std::vector<at::Tensor> init;                // CPU float32
  std::vector<std::vector<at::Tensor>> grads;  // [step][param], CPU float32
};

// `bounded`: gradients of magnitude in [0.5, 1.5] (float16's exp_avg_sq stays a normal number).
Problem make_problem(uint64_t seed, double scale, bool bounded = false) {
  at::manual_seed(seed);
  Problem pr;
  for (const auto& s : kShapes) pr.init.push_back(at::randn(s) * scale);
  for (int step = 0; step < kSteps; ++step) {
    std::vector<at::Tensor> g;
    for (const auto& s : kShapes) {
      at::Tensor r = at::randn(s);
      g.push_back(bounded ? r.sign() * (0.5 + at::rand(s)) : r);
    }
    pr.grads.push_back(std::move(g));
  }
  return pr;
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& ts, at::Device device,
                               at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts)
    out.push_back(t.to(device, dtype, /*non_blocking=*/false, /*copy=*/true));
  return out;
}

// Steps `opt` (whose parameters are `params`) through the problem's gradients, each gradient
// first rounded to `grad_dtype` (as the low-precision run sees it), then put on the parameter's
// device and dtype.
void run(FunctionalOptimizer& opt, const std::vector<at::Tensor>& params, const Problem& pr,
         int from, int to, at::ScalarType grad_dtype = at::kFloat) {
  for (int step = from; step < to; ++step) {
    std::vector<at::Tensor> g;
    for (size_t i = 0; i < params.size(); ++i) {
      g.push_back(pr.grads[step][i].to(grad_dtype).to(params[i].device(), params[i].scalar_type()));
    }
    opt.step(g);
  }
}

void run_torch(torch::optim::Optimizer& opt, std::vector<at::Tensor>& params, const Problem& pr) {
  for (int step = 0; step < kSteps; ++step) {
    for (size_t i = 0; i < params.size(); ++i)
      params[i].mutable_grad() = pr.grads[step][i].to(params[i].device());
    opt.step();
  }
}

// Every parameter close: |a - b| <= atol + rtol |b| (a on any device, b on the CPU).
void expect_close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, double rtol,
                  double atol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const at::Tensor x = a[i].detach().to(at::kCPU, at::kDouble);
    const at::Tensor y = b[i].detach().to(at::kCPU, at::kDouble);
    EXPECT_TRUE(at::allclose(x, y, rtol, atol))
        << what << ": parameter " << i << " differs by up to "
        << (x - y).abs().max().item<double>();
  }
}

using Make =
    std::function<std::unique_ptr<FunctionalOptimizer>(std::vector<at::Tensor>, bool fused)>;
using MakeTorch = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

struct Case {
  std::string name;
  Make make;
  MakeTorch libtorch;  // null where LibTorch has no equivalent (maximize)
};

template <typename Opt, typename Options>
Make maker(Options o) {
  return [o](std::vector<at::Tensor> p, bool fused) mutable {
    return std::make_unique<Opt>(std::move(p),
                                 o.fused(fused ? OptionalBool() : OptionalBool(false)));
  };
}

std::vector<Case> cases() {
  const auto betas = std::make_tuple(0.9, 0.99);
  return {
      {"Adam", maker<FunctionalAdam>(AdamOptions().lr(1e-2).betas(betas)),
       [=](std::vector<at::Tensor> p) {
         return std::make_unique<torch::optim::Adam>(p,
                                                     torch::optim::AdamOptions(1e-2).betas(betas));
       }},
      {"Adam amsgrad weight_decay",
       maker<FunctionalAdam>(AdamOptions().lr(1e-2).amsgrad(true).weight_decay(0.1)),
       [](std::vector<at::Tensor> p) {
         return std::make_unique<torch::optim::Adam>(
             p, torch::optim::AdamOptions(1e-2).amsgrad(true).weight_decay(0.1));
       }},
      {"Adam maximize", maker<FunctionalAdam>(AdamOptions().lr(1e-2).maximize(true)), nullptr},
      {"AdamW", maker<FunctionalAdamW>(AdamWOptions().lr(1e-2).weight_decay(0.05)),
       [](std::vector<at::Tensor> p) {
         return std::make_unique<torch::optim::AdamW>(
             p, torch::optim::AdamWOptions(1e-2).weight_decay(0.05));
       }},
      {"AdamW amsgrad", maker<FunctionalAdamW>(AdamWOptions().lr(1e-2).amsgrad(true)),
       [](std::vector<at::Tensor> p) {
         return std::make_unique<torch::optim::AdamW>(
             p, torch::optim::AdamWOptions(1e-2).amsgrad(true));
       }},
      {"SGD momentum nesterov",
       maker<FunctionalSGD>(SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3)),
       [](std::vector<at::Tensor> p) {
         return std::make_unique<torch::optim::SGD>(
             p, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3));
       }},
      {"SGD dampening maximize",
       maker<FunctionalSGD>(SGDOptions(0.05).momentum(0.9).dampening(0.1).maximize(true)), nullptr},
      {"SGD plain", maker<FunctionalSGD>(SGDOptions(0.1)),
       [](std::vector<at::Tensor> p) {
         return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
       }},
      {"Adagrad",
       maker<FunctionalAdagrad>(
           AdagradOptions().lr(0.1).lr_decay(0.01).weight_decay(0.01).initial_accumulator_value(
               0.1)),
       [](std::vector<at::Tensor> p) {
         return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(0.1)
                                                               .lr_decay(0.01)
                                                               .weight_decay(0.01)
                                                               .initial_accumulator_value(0.1));
       }},
      {"Adagrad maximize", maker<FunctionalAdagrad>(AdagradOptions().lr(0.1).maximize(true)),
       nullptr},
  };
}

int64_t cuda_updates() {
  auto& c = internal::cuda_path_counts();
  return c.fused.load() + c.foreach.load();
}

// fp32: the CUDA path against dtrain's CPU path (its fused CPU kernels), and against LibTorch's
// torch::optim on CUDA (per-tensor ATen ops) where it has the optimizer.
TEST_F(FunctionalCudaTest, Float32MatchesCpuPathAndLibTorch) {
  const Problem pr = make_problem(1, 1.0);
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    std::vector<at::Tensor> cpu = copies(pr.init, at::kCPU, at::kFloat);
    std::vector<at::Tensor> gpu = copies(pr.init, at::kCUDA, at::kFloat);
    auto on_cpu = c.make(cpu, true);
    auto on_gpu = c.make(gpu, true);
    const int64_t before = cuda_updates();
    run(*on_cpu, cpu, pr, 0, kSteps);
    run(*on_gpu, gpu, pr, 0, kSteps);
    EXPECT_EQ(cuda_updates() - before, kSteps)
        << "one multi-tensor update per step (one device, one dtype)";
    expect_close(gpu, cpu, 1e-5, 1e-5, "CUDA vs dtrain's CPU path");
    if (c.libtorch) {
      std::vector<at::Tensor> lt = copies(pr.init, at::kCUDA, at::kFloat);
      for (auto& p : lt) p.requires_grad_();
      auto twin = c.libtorch(lt);
      run_torch(*twin, lt, pr);
      expect_close(gpu, lt, 1e-5, 1e-5, "CUDA vs LibTorch's torch::optim on CUDA");
    }
    // fused=False: the per-tensor ATen ops on CUDA, no multi-tensor update, the same numbers.
    std::vector<at::Tensor> aten = copies(pr.init, at::kCUDA, at::kFloat);
    auto unfused = c.make(aten, false);
    const int64_t at_start = cuda_updates();
    run(*unfused, aten, pr, 0, kSteps);
    EXPECT_EQ(cuda_updates(), at_start) << "fused=False took the multi-tensor path";
    expect_close(gpu, aten, 1e-5, 1e-5, "fused vs fused=False on CUDA");
  }
}

// float16 and bfloat16 Adam and AdamW (the fused kernel computes in float32 and rounds once per
// step): against a float32 CPU run from the same rounded values. The update (final - initial) of
// the low-precision run is within a few of its dtype's roundings of the float32 one.
TEST_F(FunctionalCudaTest, LowPrecisionAdamFollowsTheFloat32Trajectory) {
  const Problem pr = make_problem(2, 0.05, /*bounded=*/true);
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    for (bool decoupled : {false, true}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (decoupled ? " AdamW" : " Adam"));
      std::vector<at::Tensor> start;  // the initial values as the low-precision run holds them
      for (const auto& t : pr.init) start.push_back(t.to(dtype).to(at::kFloat));
      std::vector<at::Tensor> ref = copies(start, at::kCPU, at::kFloat);
      std::vector<at::Tensor> low = copies(start, at::kCUDA, dtype);
      Make make = decoupled ? maker<FunctionalAdamW>(AdamWOptions().lr(1e-2).weight_decay(0.01))
                            : maker<FunctionalAdam>(AdamOptions().lr(1e-2));
      auto a = make(ref, true);
      auto b = make(low, true);
      const int64_t before = internal::cuda_path_counts().fused.load();
      run(*a, ref, pr, 0, kSteps, dtype);
      run(*b, low, pr, 0, kSteps, dtype);
      EXPECT_EQ(internal::cuda_path_counts().fused.load() - before, kSteps);
      double diff = 0, moved = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        const at::Tensor got = low[i].to(at::kCPU, at::kDouble), want = ref[i].to(at::kDouble);
        diff += (got - want).pow(2).sum().item<double>();
        moved += (want - start[i].to(at::kDouble)).pow(2).sum().item<double>();
      }
      ASSERT_GT(moved, 0);
      EXPECT_LT(std::sqrt(diff / moved), dtype == at::kHalf ? 0.01 : 0.05)
          << "relative error of the low-precision update";
    }
  }
}

template <typename Base>
class Inspect : public Base {
 public:
  using Base::Base;
  const ParamState& state_of(size_t i) const { return this->state_.at(i); }
};

// One ATen call per (device, dtype) batch, and the state PyTorch's fused path keeps: "step" a
// float32 tensor on the parameter's device (here ParamState::device_step), exported in
// state_dict as PyTorch's float32 step with the slots on the device.
TEST_F(FunctionalCudaTest, TakesTheFusedPathWithFloat32StepsOnTheDevice) {
  std::vector<at::Tensor> params = {
      at::randn({10}, at::kCUDA), at::randn({4, 4}, at::kCUDA),
      at::randn({7}, at::TensorOptions().device(at::kCUDA).dtype(at::kDouble)),
      at::randn({3}, at::kCUDA)};
  Inspect<FunctionalAdamW> adamw(params, AdamWOptions().lr(1e-3));
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(at::randn_like(p));
  const int64_t fused_before = internal::cuda_path_counts().fused.load();
  for (int s = 0; s < 3; ++s) adamw.step(grads);
  EXPECT_EQ(internal::cuda_path_counts().fused.load() - fused_before, 3 * 2)
      << "float32 and float64: two batches";
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& step = adamw.state_of(i).device_step;
    ASSERT_TRUE(step.defined()) << i;
    EXPECT_TRUE(step.is_cuda()) << i;
    EXPECT_EQ(step.scalar_type(), at::kFloat) << i;
    EXPECT_EQ(step.dim(), 0) << i;
    EXPECT_EQ(step.item<double>(), 3.0) << i;
  }
  const auto state = adamw.state_dict().toGenericDict().at("state").toGenericDict();
  const auto entry = state.at(int64_t{2}).toGenericDict();
  EXPECT_EQ(entry.at("step").toTensor().scalar_type(), at::kFloat);
  EXPECT_EQ(entry.at("step").toTensor().item<double>(), 3.0);
  EXPECT_TRUE(entry.at("exp_avg").toTensor().is_cuda());
  EXPECT_EQ(entry.at("exp_avg").toTensor().scalar_type(), at::kDouble);

  // Adagrad: the foreach ops by default (PyTorch's CUDA default); ATen's fused CUDA kernel with
  // fused=True where this LibTorch has one.
  for (bool ask_fused : {false, true}) {
    Inspect<FunctionalAdagrad> adagrad(params,
                                       ask_fused ? AdagradOptions().fused(true) : AdagradOptions());
    const int64_t fused = internal::cuda_path_counts().fused.load();
    const int64_t foreach = internal::cuda_path_counts().foreach.load();
    adagrad.step(grads);
    const bool kernel = ask_fused && has_cuda_kernel("aten::_fused_adagrad_");
    EXPECT_EQ(internal::cuda_path_counts().fused.load() - fused, kernel ? 2 : 0);
    EXPECT_EQ(internal::cuda_path_counts().foreach.load() - foreach, kernel ? 0 : 2);
    EXPECT_EQ(adagrad.state_of(0).device_step.item<double>(), 1.0);
  }
}

// A parameter the fused kernels cannot take (a strided view) runs the ATen ops while the others
// are fused, and SGD's momentum buffers that start at different steps (a parameter without a
// gradient at first) split its batch by ATen's is_first_step: both as dtrain's CPU path.
TEST_F(FunctionalCudaTest, MixedLayoutsAndLateMomentumBuffersMatchTheCpuPath) {
  at::manual_seed(4);
  const at::Tensor base = at::randn({8, 66});
  const std::vector<at::Tensor> dense = {at::randn({33}), at::randn({5, 5}), at::randn({9})};
  auto build = [&](at::Device d) {
    std::vector<at::Tensor> p = copies(dense, d, at::kFloat);
    p.push_back(base.to(d, at::kFloat, false, true).slice(1, 0, 66, 2));  // strides (66, 2)
    return p;
  };
  std::vector<at::Tensor> cpu = build(at::kCPU), gpu = build(at::kCUDA);
  std::vector<std::vector<at::Tensor>> grads;
  for (int s = 0; s < 6; ++s) {
    std::vector<at::Tensor> g;
    for (size_t i = 0; i < cpu.size(); ++i)
      g.push_back(s == 0 && i == 1 ? at::Tensor() : at::randn(cpu[i].sizes()));
    grads.push_back(std::move(g));
  }
  const SGDOptions options = SGDOptions(0.05).momentum(0.9).weight_decay(1e-2);
  FunctionalSGD a(cpu, options);
  Inspect<FunctionalSGD> b(gpu, options);
  const int64_t before = internal::cuda_path_counts().fused.load();
  for (int s = 0; s < 6; ++s) {
    std::vector<at::Tensor> on_gpu;
    for (const auto& g : grads[s]) on_gpu.push_back(g.defined() ? g.to(at::kCUDA) : at::Tensor());
    a.step(grads[s]);
    b.step(on_gpu);
  }
  // Step 1: one batch (2 new buffers); step 2: new (parameter 1) and old buffers; then one each.
  EXPECT_EQ(internal::cuda_path_counts().fused.load() - before, 1 + 2 + 4);
  EXPECT_TRUE(b.state_of(3).slots[0].defined())
      << "the strided parameter has its momentum buffer (ATen path)";
  expect_close(gpu, cpu, 1e-5, 1e-5, "CUDA vs CPU");
}

// A state dict saved after some CUDA steps and loaded into a fresh optimizer continues exactly as
// the original: the loaded step (a CPU float32 tensor) becomes the device step again.
TEST_F(FunctionalCudaTest, LoadedStateContinuesTheTrajectoryExactly) {
  const Problem pr = make_problem(5, 1.0);
  for (bool amsgrad : {false, true}) {
    SCOPED_TRACE(amsgrad ? "amsgrad" : "plain");
    std::vector<at::Tensor> a = copies(pr.init, at::kCUDA, at::kFloat);
    FunctionalAdam opt_a(a, AdamOptions().lr(1e-2).amsgrad(amsgrad));
    run(opt_a, a, pr, 0, kSteps / 2);
    std::vector<at::Tensor> b;
    for (const auto& t : a) b.push_back(t.clone());
    FunctionalAdam opt_b(b, AdamOptions());
    opt_b.load_state_dict(opt_a.state_dict());
    EXPECT_TRUE(opt_b.options().amsgrad() == amsgrad && opt_b.options().lr() == 1e-2);
    run(opt_a, a, pr, kSteps / 2, kSteps);
    run(opt_b, b, pr, kSteps / 2, kSteps);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].equal(b[i])) << "param " << i;
  }
}

// `fused` is an option of these four: None by default, True and False accepted, shown in the
// param group; other optimizers still refuse fused=True. (CPU tensors: runs without a GPU too.)
TEST(FunctionalFusedOptionTest, RoundTripsThroughTheParamGroup) {
  FunctionalSGD sgd({at::zeros({2})}, SGDOptions(0.1));
  EXPECT_TRUE(sgd.options_dict().at("fused").isNone());
  OptionsDict off = new_options_dict();
  off.insert("fused", false);
  sgd.set_options(off);
  EXPECT_EQ(sgd.options().fused(), OptionalBool(false));
  EXPECT_FALSE(sgd.options_dict().at("fused").toBool());
  OptionsDict on = new_options_dict();
  on.insert("fused", true);
  sgd.set_options(on);
  EXPECT_EQ(sgd.options().fused(), OptionalBool(true));
  FunctionalAdamax adamax({at::zeros({2})}, AdamaxOptions());
  EXPECT_THROW(adamax.set_options(on), c10::Error);
}

}  // namespace
}  // namespace dtrain::optim
