// dtrain's CUDA optimizers against PyTorch's on the same GPU, step for step (tags = ["gpu"]):
// optim/functional/testdata/make_cuda_reference.py writes torch.optim's Adam, AdamW and SGD with fused=True
// and Adagrad with foreach=True (PyTorch refuses fused Adagrad on CUDA) on CUDA (bench/gpu/run_on_gpu runs it with the GPU machine's PyTorch and passes the
// file in DTRAIN_CUDA_REFERENCE); each case here takes the same parameters and gradients (the same
// formulas, computed on the CPU in float32) through dtrain's default CUDA path. Same kernels, same
// arguments: the parameters must be bit-identical, and the count of identical tensors is printed.
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "checkpoint/torch_file_reader.h"
#include "comm/testing/gpu_testing.h"
#include "optim/functional/optimizers.h"

namespace dtrain::optim {
namespace {

const std::vector<std::vector<int64_t>> kShapes = {{37}, {8, 33}, {3, 4, 5}, {1}, {70001}};
constexpr int kSteps = 10;

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}
at::Tensor initial(int i, const std::vector<int64_t>& s) {
  return at::sin(at::arange(numel(s), at::kFloat) * 0.37 + i).view(s);
}
at::Tensor gradient(int i, int step, const std::vector<int64_t>& s) {
  return at::cos(at::arange(numel(s), at::kFloat) * 0.11 + (step * 1.3 + i)).view(s);
}

using Make = std::function<std::unique_ptr<FunctionalOptimizer>(std::vector<at::Tensor>)>;

c10::IValue reference() {
  const char* path = std::getenv("DTRAIN_CUDA_REFERENCE");
  if (path == nullptr) return c10::IValue();
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  absl::StatusOr<c10::IValue> v = checkpoint::read_torch_file(bytes, path);
  EXPECT_TRUE(v.ok()) << v.status();
  return v.ok() ? *v : c10::IValue();
}

void check(const std::string& name, const Make& make) {
  DTRAIN_GPU_TEST_OR_SKIP();
  const c10::IValue ref = reference();
  if (!ref.isGenericDict()) {
    if (comm::testing::gpu_required()) FAIL() << "DTRAIN_CUDA_REFERENCE names no reference file";
    GTEST_SKIP()
        << "DTRAIN_CUDA_REFERENCE is not set (bench/gpu/run_on_gpu writes it with PyTorch)";
  }
  const c10::IValue entry = ref.toGenericDict().at(name);
  if (entry.isString())
    GTEST_SKIP() << "PyTorch " << ref.toGenericDict().at("torch_version").toStringRef()
                 << " cannot run it: " << entry.toStringRef();
  const c10::List<c10::IValue> steps = entry.toList();
  ASSERT_EQ(steps.size(), static_cast<size_t>(kSteps));
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < kShapes.size(); ++i) params.push_back(initial(i, kShapes[i]).cuda());
  std::unique_ptr<FunctionalOptimizer> opt = make(params);
  int identical = 0, total = 0;
  double worst = 0;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < kShapes.size(); ++i)
      grads.push_back(gradient(i, step, kShapes[i]).cuda());
    opt->step(grads);
    const c10::List<c10::IValue> want = steps.get(step).toList();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor got = params[i].cpu(), expected = want.get(i).toTensor();
      ++total;
      identical += got.equal(expected) ? 1 : 0;
      worst = std::max(worst, (got - expected).abs().max().item<double>());
    }
  }
  std::cout << name << ": " << identical << " of " << total
            << " parameter tensors bit-identical to PyTorch "
            << ref.toGenericDict().at("torch_version").toStringRef()
            << " on CUDA; largest difference " << worst << "\n";
  EXPECT_EQ(identical, total) << name << ": largest difference " << worst;
}

TEST(FunctionalCudaPyTorchTest, Adam) {
  check("adam", [](std::vector<at::Tensor> p) {
    return std::make_unique<FunctionalAdam>(
        p,
        AdamOptions().lr(1e-2).betas(std::make_tuple(0.9, 0.99)).weight_decay(0.01).amsgrad(true));
  });
}
TEST(FunctionalCudaPyTorchTest, AdamW) {
  check("adamw", [](std::vector<at::Tensor> p) {
    return std::make_unique<FunctionalAdamW>(p, AdamWOptions().lr(1e-2).weight_decay(0.1));
  });
}
TEST(FunctionalCudaPyTorchTest, SGD) {
  check("sgd", [](std::vector<at::Tensor> p) {
    return std::make_unique<FunctionalSGD>(
        p, SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(1e-3));
  });
}
TEST(FunctionalCudaPyTorchTest, Adagrad) {
  check("adagrad", [](std::vector<at::Tensor> p) {
    return std::make_unique<FunctionalAdagrad>(
        p, AdagradOptions().lr(0.1).lr_decay(0.01).weight_decay(1e-3));
  });
}

}  // namespace
}  // namespace dtrain::optim
