#include "optim/registry.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "optim/functional_optimizers.h"
#include "optim/reference_testing.h"

namespace dtrain::optim {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

// A user's optimizer, written against the public interface only: quasi-hyperbolic momentum
// (the seed recipe's QHM, with the momentum buffer kept across steps).
class FunctionalQHM : public FunctionalOptimizer {
 public:
  FunctionalQHM(std::vector<at::Tensor> params, const OptionsDict& options) : FunctionalOptimizer(std::move(params)) {
    OptionsDict d = defaults();
    for (const auto& kv : options) d.insert_or_assign(kv.key(), kv.value());
    apply(d);
  }
  std::string name() const override { return "QHM"; }
  double lr() const override { return lr_; }
  void set_lr(double lr) override {
    TORCH_CHECK(lr >= 0, "Invalid learning rate: ", lr);
    lr_ = lr;
  }
  OptionsDict options_dict() const override {
    OptionsDict d = new_options_dict();
    d.insert("lr", lr_);
    d.insert("momentum", momentum_);
    d.insert("nu", nu_);
    d.insert("weight_decay", weight_decay_);
    d.insert("weight_decay_type", direct_ ? "direct" : "grad");
    return d;
  }

 protected:
  static OptionsDict defaults() {
    OptionsDict d = new_options_dict();
    d.insert("lr", 1e-3);
    d.insert("momentum", 0.0);
    d.insert("nu", 0.7);
    d.insert("weight_decay", 0.0);
    d.insert("weight_decay_type", "grad");
    return d;
  }
  void apply_options(const OptionsDict& merged) override { apply(merged); }
  void apply(const OptionsDict& d) {
    const double lr = d.at("lr").toDouble(), momentum = d.at("momentum").toDouble();
    const double wd = d.at("weight_decay").toDouble();
    const std::string type = d.at("weight_decay_type").toStringRef();
    TORCH_CHECK(lr >= 0, "Invalid learning rate: ", lr);
    TORCH_CHECK(momentum >= 0, "Invalid momentum value: ", momentum);
    TORCH_CHECK(wd >= 0, "Invalid weight_decay value: ", wd);
    TORCH_CHECK(type == "grad" || type == "direct", "Invalid weight_decay_type value: ", type);
    lr_ = lr;
    momentum_ = momentum;
    nu_ = d.at("nu").toDouble();
    weight_decay_ = wd;
    direct_ = type == "direct";
  }
  void update(size_t i, const at::Tensor& grad) override {
    at::Tensor& p = params_[i];
    ParamState& s = state_[i];
    at::Tensor d_p = grad;
    if (weight_decay_ != 0) {
      if (direct_) {
        p.mul_(1.0 - lr_ * weight_decay_);
      } else {
        d_p = d_p.add(p, weight_decay_);
      }
    }
    if (!s.initialized) {
      s.initialized = true;
      s.slots[0] = at::zeros_like(p);
    }
    s.slots[0].mul_(momentum_).add_(d_p, 1.0 - momentum_);
    p.add_(s.slots[0], -lr_ * nu_);
    p.add_(d_p, -lr_ * (1.0 - nu_));
  }
  StepKind step_kind() const override { return StepKind::kNone; }
  std::array<const char*, 4> slot_names() const override { return {"momentum_buffer", "", "", ""}; }

 private:
  double lr_ = 0, momentum_ = 0, nu_ = 0, weight_decay_ = 0;
  bool direct_ = false;
};

// A user's LibTorch-side optimizer type, mapped to its functional twin.
struct TorchQHM {};

void register_qhm() {
  auto& r = FunctionalRegistry::global();
  r.register_optimizer("QHM", [](std::vector<at::Tensor> params, const OptionsDict& options) {
    return std::unique_ptr<FunctionalOptimizer>(std::make_unique<FunctionalQHM>(std::move(params), options));
  });
  r.register_twin<TorchQHM>("QHM");
}

TEST(RegistryTest, UserQHMThroughTheRegistryMatchesPyTorch) {
  register_qhm();
  for (const auto& c : testing::read_reference("optim/testdata/qhm.ref")) {
    SCOPED_TRACE(c.name);
    for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
      std::vector<at::Tensor> params;
      for (const auto& t : c.init) params.push_back(t.to(dtype));
      auto opt = FunctionalRegistry::global().create<TorchQHM>(params, c.options);
      EXPECT_EQ(opt->name(), "QHM");
      double worst = 0;
      for (int step = 0; step < c.steps; ++step) {
        std::vector<at::Tensor> grads;
        for (size_t i = 0; i < params.size(); ++i)
          grads.push_back(c.missing[step][i] ? at::Tensor() : c.grads[step][i].to(dtype));
        opt->step(grads);
        const auto& want = dtype == at::kDouble ? c.params64[step] : c.params32[step];
        for (size_t i = 0; i < params.size(); ++i) worst = std::max(worst, testing::relative_error(params[i], want[i]));
      }
      EXPECT_LE(worst, dtype == at::kDouble ? 1e-12 : 1e-6) << dtype;
      // The generic state dict works for user optimizers too.
      auto state = opt->state_dict().toGenericDict().at("state").toGenericDict();
      EXPECT_EQ(state.size(), 3u);
    }
  }
}

TEST(RegistryTest, BuiltinsAndTwins) {
  auto& r = FunctionalRegistry::global();
  for (const char* name : {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop", "Rprop"}) {
    EXPECT_TRUE(r.contains(name)) << name;
  }
  EXPECT_TRUE(r.has_twin<torch::optim::Adam>());
  EXPECT_TRUE(r.has_twin<torch::optim::SGD>());
  std::vector<at::Tensor> p = {at::zeros({2})};
  auto adam = r.create<torch::optim::Adam>(p, options_from_torch(torch::optim::AdamOptions(0.05).betas({0.8, 0.9})));
  ASSERT_NE(dynamic_cast<FunctionalAdam*>(adam.get()), nullptr);
  EXPECT_EQ(adam->lr(), 0.05);
  auto betas = adam->options_dict().at("betas").toTupleRef().elements();
  EXPECT_EQ(betas[0].toDouble(), 0.8);
  auto sgd = r.create<torch::optim::SGD>(p, options_from_torch(torch::optim::SGDOptions(0.3).momentum(0.9)));
  EXPECT_EQ(sgd->name(), "SGD");
  EXPECT_EQ(sgd->options_dict().at("momentum").toDouble(), 0.9);
}

TEST(RegistryTest, ClearErrors) {
  auto& r = FunctionalRegistry::global();
  std::vector<at::Tensor> p = {at::zeros({2})};
  try {
    r.create("Lion", p, new_options_dict());
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("no functional optimizer named 'Lion' is registered (known: "));
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("Adam"));
  }
  try {
    r.create("SGD", p, new_options_dict());
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("SGD needs an 'lr' option"));
  }
  struct Unknown {};
  EXPECT_FALSE(r.has_twin<Unknown>());
  try {
    r.register_twin<Unknown>("NotThere");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("no functional optimizer named 'NotThere'"));
  }
  EXPECT_THAT(r.names(), Contains("Rprop"));
}

}  // namespace
}  // namespace dtrain::optim
