// A user's optimizer for tests: quasi-hyperbolic momentum (the seed recipe's QHM, with the
// momentum buffer kept across steps), written against FunctionalOptimizer's public interface
// only, as a user would. Shared by optim's registry test and rpc's remote-optimizer test.
//
//   dtrain::optim::testing::register_qhm();                 // "QHM" in the global registry
//   auto qhm = FunctionalRegistry::global().create("QHM", params, options);
#ifndef DTRAIN_OPTIM_TESTING_QHM_H_
#define DTRAIN_OPTIM_TESTING_QHM_H_

#include <ATen/ATen.h>

#include "optim/functional/optimizer.h"

namespace dtrain::optim::testing {

class FunctionalQHM : public FunctionalOptimizer {
 public:
  FunctionalQHM(std::vector<at::Tensor> params, const OptionsDict& options)
      : FunctionalOptimizer(std::move(params)) {
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

// A user's LibTorch-side optimizer type, mapped to QHM as its functional twin.
struct TorchQHM {};

// Registers "QHM" and the TorchQHM twin in FunctionalRegistry::global() (idempotent).
void register_qhm();

}  // namespace dtrain::optim::testing

#endif  // DTRAIN_OPTIM_TESTING_QHM_H_
