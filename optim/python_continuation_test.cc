// PyTorch writes optimizer checkpoints in the middle of training (optim/testdata/make_continuation.py,
// run at test time with the installed PyTorch); dtrain reads each file with checkpoint::load_state,
// loads the state dict into every optimizer that can take it -- the functional optimizer, the
// adapter, LibTorch's own optimizer, ZeroRedundancyOptimizer at world 2 and 3 under both partition
// strategies -- feeds the gradients Python fed next, and must end where Python ended.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "checkpoint/state_file.h"
#include "comm/testing/test_harness.h"
#include "optim/functional/adapter.h"
#include "optim/functional/registry.h"
#include "optim/functional/torch_state.h"
#include "optim/zero/zero_redundancy_optimizer.h"
#include "testing/pytorch_python.h"

namespace dtrain::optim {
namespace {

struct Case {
  std::string name;
  std::string optimizer;  // PyTorch's class name
  std::vector<at::Tensor> model;
  c10::IValue state_dict;
  std::vector<std::vector<at::Tensor>> grads;
  std::vector<at::Tensor> after;
  std::vector<std::vector<int64_t>> groups;  // global parameter indices per param group
};

std::string python() { return dtrain::testing::pytorch_python(); }

class PythonContinuationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* tmp = std::getenv("TEST_TMPDIR");
    dir_ = new std::string(std::string(tmp != nullptr ? tmp : "/tmp") + "/continuation");
    const std::string cmd = python() + " optim/testdata/make_continuation.py " + *dir_;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  static std::vector<std::string> case_names() {
    std::vector<std::string> names;
    std::ifstream in(*dir_ + "/cases.txt");
    for (std::string line; std::getline(in, line);) {
      if (!line.empty()) names.push_back(line);
    }
    return names;
  }
  static Case load(const std::string& name) {
    absl::StatusOr<c10::IValue> v = checkpoint::load_state(*dir_ + "/" + name + ".pt");
    TORCH_CHECK(v.ok(), v.status().ToString());
    c10::impl::GenericDict d = v->toGenericDict();
    Case c;
    c.name = name;
    c.optimizer = d.at("optimizer").toStringRef();
    for (const auto& kv : d.at("model").toGenericDict()) c.model.push_back(kv.value().toTensor());
    c.state_dict = d.at("state_dict");
    for (const auto& step : d.at("grads").toList()) {
      std::vector<at::Tensor> gs;
      for (const auto& g : step.get().toList()) gs.push_back(g.get().toTensor());
      c.grads.push_back(gs);
    }
    for (const auto& p : d.at("after").toList()) c.after.push_back(p.get().toTensor());
    for (const auto& g : c.state_dict.toGenericDict().at("param_groups").toList()) {
      std::vector<int64_t> idx;
      for (const auto& i : g.get().toGenericDict().at("params").toList())
        idx.push_back(i.get().toInt());
      c.groups.push_back(idx);
    }
    return c;
  }
  static std::string* dir_;
};
std::string* PythonContinuationTest::dir_ = nullptr;

std::vector<at::Tensor> fresh_params(const Case& c) {
  std::vector<at::Tensor> out;
  for (const auto& p : c.model) out.push_back(p.clone().requires_grad_());
  return out;
}

std::vector<torch::optim::OptimizerParamGroup> param_groups(const Case& c,
                                                            const std::vector<at::Tensor>& params) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& idx : c.groups) {
    std::vector<at::Tensor> ps;
    for (int64_t i : idx) ps.push_back(params[static_cast<size_t>(i)]);
    groups.emplace_back(ps);
  }
  return groups;
}

// Python's continuation, float32 to within a few ulps of summation order, float64 tighter.
void expect_matches_python(const Case& c, const std::vector<at::Tensor>& params,
                           const std::string& who) {
  ASSERT_EQ(params.size(), c.after.size()) << who;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor got = params[i].detach();
    const at::Tensor& want = c.after[i];
    ASSERT_EQ(got.scalar_type(), want.scalar_type()) << who << " param " << i;
    const double tol = want.scalar_type() == at::kDouble ? 1e-12 : 1e-6;
    EXPECT_TRUE(got.allclose(want, tol, tol))
        << c.name << ", " << who << ": param " << i << " differs from Python by "
        << (got - want).abs().max().item<double>();
  }
}

void set_grads(std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads) {
  for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i].clone();
}

OptionsDict lr_only() {
  OptionsDict d = new_options_dict();
  d.insert("lr", 0.5);  // replaced by the loaded param groups' own
  return d;
}

std::unique_ptr<torch::optim::Optimizer> libtorch_optimizer(
    const std::string& name, std::vector<torch::optim::OptimizerParamGroup> groups) {
  using namespace torch::optim;  // NOLINT
  if (name == "Adam") return std::make_unique<Adam>(std::move(groups), AdamOptions(0.5));
  if (name == "AdamW") return std::make_unique<AdamW>(std::move(groups), AdamWOptions(0.5));
  if (name == "SGD") return std::make_unique<SGD>(std::move(groups), SGDOptions(0.5));
  if (name == "Adagrad") return std::make_unique<Adagrad>(std::move(groups), AdagradOptions(0.5));
  if (name == "RMSprop") return std::make_unique<RMSprop>(std::move(groups), RMSpropOptions(0.5));
  return nullptr;  // LibTorch has no Adamax, Adadelta or Rprop
}

TEST_F(PythonContinuationTest, FunctionalOptimizersContinueAsPython) {
  int checked = 0;
  for (const std::string& name : case_names()) {
    const Case c = load(name);
    if (c.groups.size() != 1) continue;  // a functional optimizer has one group: the adapter's case
    std::vector<at::Tensor> params = fresh_params(c);
    auto opt = FunctionalRegistry::global().create(c.optimizer, params, lr_only());
    opt->load_state_dict(c.state_dict);
    for (const auto& gs : c.grads) opt->step(gs);
    expect_matches_python(c, params, "functional " + c.optimizer);
    ++checked;
  }
  EXPECT_GE(checked, 12);
}

TEST_F(PythonContinuationTest, AdapterContinuesAsPythonAndKeepsTheSchedulersKeys) {
  int checked = 0;
  for (const std::string& name : case_names()) {
    const Case c = load(name);
    std::vector<at::Tensor> params = fresh_params(c);
    FunctionalOptimizerAdapter opt(param_groups(c, params), c.optimizer, lr_only());
    opt.load_state_dict(c.state_dict);
    for (const auto& gs : c.grads) {
      set_grads(params, gs);
      opt.step();
    }
    expect_matches_python(c, params, "adapter " + c.optimizer);
    // Keys PyTorch put in the groups (initial_lr after a scheduler, 2.x's foreach/fused...) come back.
    auto want = c.state_dict.toGenericDict().at("param_groups").toList();
    auto got = opt.state_dict().toGenericDict().at("param_groups").toList();
    ASSERT_EQ(got.size(), want.size()) << name;
    for (size_t g = 0; g < want.size(); ++g) {
      for (const auto& kv : want.get(g).toGenericDict()) {
        EXPECT_TRUE(got.get(g).toGenericDict().contains(kv.key()))
            << name << " group " << g << " lost " << kv.key().toStringRef();
      }
    }
    ++checked;
  }
  EXPECT_GE(checked, 17);
}

TEST_F(PythonContinuationTest, LibTorchOptimizersContinueAsPython) {
  int checked = 0;
  for (const std::string& name : case_names()) {
    const Case c = load(name);
    std::vector<at::Tensor> params = fresh_params(c);
    std::unique_ptr<torch::optim::Optimizer> opt =
        libtorch_optimizer(c.optimizer, param_groups(c, params));
    if (opt == nullptr) continue;
    const auto group0 =
        c.state_dict.toGenericDict().at("param_groups").toList().get(0).toGenericDict();
    if (c.optimizer == "Adam" && group0.contains("decoupled_weight_decay") &&
        group0.at("decoupled_weight_decay").toBool()) {
      continue;  // LibTorch's Adam has no decoupled weight decay
    }
    load_torch_optim_state_dict(*opt, c.state_dict);
    for (const auto& gs : c.grads) {
      set_grads(params, gs);
      opt->step();
    }
    expect_matches_python(c, params, "torch::optim::" + c.optimizer);
    ++checked;
  }
  EXPECT_GE(checked, 13);
}

// The other direction: what dtrain's optimizers hand back after continuing, saved with save_state,
// loads into PyTorch's optimizer and goes on exactly as PyTorch's own (check_continuation.py).
TEST_F(PythonContinuationTest, PyTorchContinuesFromTheStateDtrainWrote) {
  for (const char* who : {"functional", "adapter"}) {
    for (const std::string& name : case_names()) {
      const Case c = load(name);
      std::vector<at::Tensor> params = fresh_params(c);
      c10::IValue sd;
      if (std::string(who) == "functional" && c.groups.size() == 1) {
        auto opt = FunctionalRegistry::global().create(c.optimizer, params, lr_only());
        opt->load_state_dict(c.state_dict);
        for (const auto& gs : c.grads) opt->step(gs);
        sd = opt->state_dict();
      } else {
        FunctionalOptimizerAdapter opt(param_groups(c, params), c.optimizer, lr_only());
        opt.load_state_dict(c.state_dict);
        for (const auto& gs : c.grads) {
          set_grads(params, gs);
          opt.step();
        }
        sd = opt.state_dict();
      }
      c10::impl::GenericList ps(c10::AnyType::get());
      for (const auto& p : params) ps.push_back(p.detach());
      c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
      out.insert("params", ps);
      out.insert("state_dict", sd);
      absl::Status s = checkpoint::save_state(*dir_ + "/" + name + "." + who + ".pt", out);
      ASSERT_TRUE(s.ok()) << s;
    }
    const std::string cmd =
        python() + " optim/testdata/check_continuation.py " + *dir_ + " " + who + " 2>&1";
    FILE* pipe = ::popen(cmd.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    std::string output;
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) output.append(buf, n);
    EXPECT_EQ(::pclose(pipe), 0) << who << ":\n" << output;
    EXPECT_EQ(output.find("FAIL"), std::string::npos) << output;
    EXPECT_NE(output.find("adam_scheduler ok"), std::string::npos) << output;
  }
}

TEST_F(PythonContinuationTest, ZeroAtWorld2And3UnderBothStrategiesContinuesAsPython) {
  std::vector<Case> cases;
  for (const std::string& name : case_names()) cases.push_back(load(name));
  for (int world : {2, 3}) {
    for (PartitionStrategy strategy :
         {PartitionStrategy::kSortedGreedy, PartitionStrategy::kFlat}) {
      const std::string who = "ZeRO world " + std::to_string(world) +
                              (strategy == PartitionStrategy::kFlat ? " flat" : " sorted_greedy");
      comm::testing::run_ranks_as_threads(world, [&](comm::Group& g) {
        for (const Case& c : cases) {
          std::vector<at::Tensor> params = fresh_params(c);
          ZeroOptions o;
          o.group = g;
          o.strategy = strategy;
          o.flat_alignment = 4;
          ZeroRedundancyOptimizer zero(
              param_groups(c, params),
              local_optimizer<FunctionalOptimizerAdapter>(c.optimizer, lr_only()), o);
          zero.load_state_dict(c.state_dict);
          for (const auto& gs : c.grads) {
            set_grads(params, gs);  // every rank the same: DDP's average of equal gradients
            zero.step();
          }
          expect_matches_python(c, params, who + " rank " + std::to_string(g.rank()));
        }
      });
    }
  }
}

}  // namespace
}  // namespace dtrain::optim
