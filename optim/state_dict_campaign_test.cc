// The hostile state-dict campaign: PyTorch writes real optimizer states (Adam, AdamW, SGD with
// momentum, RMSprop, Adagrad, Adafactor, Muon: optim/testdata/make_campaign_states.py, at test
// time), optim/hostile_state_dicts.h makes every damaged or edited variant of each, and each is
// loaded into the functional optimizer (from memory, and from a checksum-valid file save_state
// wrote), the adapter and ZeroRedundancyOptimizer (two ranks, every
// rank checking the whole dict). Nothing may crash or abort; nothing refused may be accepted
// (NaN/inf never silently); each refusal is one line naming the key and the parameter's index in
// the file, the same on every rank; what PyTorch accepts stays accepted. The counts are printed.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "checkpoint/state_file.h"
#include "comm/testing/test_harness.h"
#include "optim/functional/adapter.h"
#include "optim/functional/registry.h"
#include "optim/hostile_state_dicts.h"
#include "optim/zero/zero_redundancy_optimizer.h"
#include "testing/pytorch_python.h"

namespace dtrain::optim {
namespace {

using testing::Hostile;
using testing::hostile_variants;

struct Base {
  std::string name, optimizer;
  std::vector<at::Tensor> model;
  c10::IValue state_dict;
  c10::IValue missing_options;  // make_campaign_states.py's oracle; None where dtrain wrote it
};

// The cases of make_campaign_states.py: (name, optimizer, shapes) -- written by dtrain itself where
// the installed PyTorch lacks the optimizer (Muon before 2.9).
struct Spec {
  const char* name;
  const char* optimizer;
  std::vector<std::vector<int64_t>> shapes;
};
const std::vector<Spec>& specs() {
  static const std::vector<Spec> s = {
      {"adam", "Adam", {{3, 4}, {5}, {2, 3}}},   {"adam_amsgrad", "Adam", {{4}, {2, 2}}},
      {"adamw", "AdamW", {{3, 4}, {5}}},         {"sgd_momentum", "SGD", {{3, 4}, {5}, {2}}},
      {"rmsprop", "RMSprop", {{3, 4}, {5}}},     {"adagrad", "Adagrad", {{3, 4}, {5}}},
      {"adafactor", "Adafactor", {{3, 4}, {5}}}, {"muon", "Muon", {{3, 4}, {4, 2}}},
  };
  return s;
}

OptionsDict lr_only() {
  OptionsDict o = new_options_dict();
  o.insert("lr", 0.01);
  return o;
}

std::vector<at::Tensor> fresh(const std::vector<at::Tensor>& model) {
  std::vector<at::Tensor> out;
  for (const auto& p : model) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

class Campaign : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* tmp = std::getenv("TEST_TMPDIR");
    const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/campaign";
    const std::string cmd =
        dtrain::testing::pytorch_python() + " optim/testdata/make_campaign_states.py " + dir;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::set<std::string> by_pytorch;
    std::ifstream in(dir + "/cases.txt");
    for (std::string line; std::getline(in, line);) {
      if (!line.empty()) by_pytorch.insert(line);
    }
    bases_ = new std::vector<Base>();
    for (const Spec& spec : specs()) {
      Base b;
      b.name = spec.name;
      b.optimizer = spec.optimizer;
      if (by_pytorch.count(spec.name) > 0) {
        absl::StatusOr<c10::IValue> v = checkpoint::load_state(dir + "/" + b.name + ".pt");
        ASSERT_TRUE(v.ok()) << v.status();
        for (const auto& kv : v->toGenericDict().at("model").toGenericDict())
          b.model.push_back(kv.value().toTensor());
        b.state_dict = v->toGenericDict().at("state_dict");
        b.missing_options = v->toGenericDict().at("missing_options");
      } else {
        std::printf("campaign: %s's state written by dtrain (the installed PyTorch lacks %s)\n",
                    spec.name, spec.optimizer);
        at::manual_seed(7);
        for (const auto& shape : spec.shapes) b.model.push_back(at::randn(shape));
        auto opt = FunctionalRegistry::global().create(b.optimizer, b.model, lr_only());
        for (int s = 0; s < 2; ++s) {
          std::vector<at::Tensor> grads;
          for (const auto& p : b.model) grads.push_back(at::randn_like(p));
          opt->step(grads);
        }
        b.state_dict = opt->state_dict();
      }
      bases_->push_back(std::move(b));
    }
  }
  static std::vector<Base>* bases_;
};
std::vector<Base>* Campaign::bases_ = nullptr;

// What one load did.
struct Outcome {
  bool threw = false;
  std::string message;      // c10::Error's, without the backtrace
  std::string wrong_error;  // another exception type escaped
};

template <typename F>
Outcome attempt(F&& load) {
  Outcome o;
  try {
    load();
  } catch (const c10::Error& e) {
    o.threw = true;
    o.message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    o.threw = true;
    o.wrong_error = e.what();
  }
  return o;
}

// The tallies the test prints and asserts on.
struct Tally {
  std::map<std::string, int> refused_by_kind, accepted_by_kind;
  int total = 0, refused = 0, accepted = 0, failures = 0;

  void judge(const std::string& target, const Hostile& h, const Outcome& o) {
    ++total;
    const std::string who = target + " / " + h.label;
    if (!o.wrong_error.empty()) {
      ++failures;
      ADD_FAILURE() << who << ": threw a non-c10 exception: " << o.wrong_error;
      return;
    }
    if (h.refused != o.threw) {
      ++failures;
      ADD_FAILURE() << who
                    << (o.threw ? ": refused, PyTorch accepts it: " + o.message
                                : ": accepted silently");
      return;
    }
    if (!o.threw) {
      ++accepted;
      ++accepted_by_kind[h.kind];
      return;
    }
    ++refused;
    ++refused_by_kind[h.kind];
    bool ok = o.message.find('\n') == std::string::npos;
    for (const std::string& n : h.names) ok = ok && o.message.find(n) != std::string::npos;
    if (!ok) {
      ++failures;
      ADD_FAILURE() << who << ": the refusal should be one line naming "
                    << ::testing::PrintToString(h.names) << ": " << o.message;
    }
  }
  void print(const char* what) const {
    std::printf(
        "campaign %s: %d hostile state dicts loaded: %d refused, %d accepted as PyTorch "
        "accepts them, %d failures\n",
        what, total, refused, accepted, failures);
    for (const auto& [kind, n] : refused_by_kind)
      std::printf("  refused  %-28s %d\n", kind.c_str(), n);
    for (const auto& [kind, n] : accepted_by_kind)
      std::printf("  accepted %-28s %d\n", kind.c_str(), n);
  }
};

// An accepted variant that dropped an option: the loaded group has PyTorch's value for it.
void expect_option_after(const c10::IValue& state_dict, const Hostile& h,
                         const std::string& target) {
  if (h.option_key.empty()) return;
  const auto group = state_dict.toGenericDict().at("param_groups").toList().get(0).toGenericDict();
  ASSERT_TRUE(group.contains(h.option_key)) << target << " / " << h.label;
  const c10::IValue got = group.at(h.option_key), want = h.option_after;
  const bool same = (got.isNone() && want.isNone()) ||
                    (got.isBool() && want.isBool() && got.toBool() == want.toBool()) ||
                    ((got.isDouble() || got.isInt()) && (want.isDouble() || want.isInt()) &&
                     got.toScalar().toDouble() == want.toScalar().toDouble());
  EXPECT_TRUE(same) << target << " / " << h.label << ": the option is " << got
                    << " after the load, PyTorch's load gives " << want;
}

// A step after an accepted load leaves the parameters finite (unless PyTorch's would not be).
void expect_finite_after(const std::vector<at::Tensor>& params, const Hostile& h,
                         const std::string& target) {
  if (h.may_go_non_finite) return;
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::isfinite(params[i].detach()).all().item<bool>())
        << target << " / " << h.label << ": parameter " << i << " is not finite after a step";
  }
}

std::string file_dir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return tmp != nullptr ? tmp : "/tmp";
}

TEST_F(Campaign, FunctionalOptimizersAndTheAdapterRefuseEveryHostileStateDict) {
  Tally tally;
  int files = 0, unwritable = 0;
  std::set<std::string> optimizers;
  for (const Base& b : *bases_) {
    const std::vector<Hostile> variants =
        hostile_variants(b.state_dict, b.model, b.optimizer, b.missing_options);
    optimizers.insert(b.optimizer);
    for (const Hostile& h : variants) {
      std::vector<at::Tensor> params = fresh(b.model);
      auto functional = FunctionalRegistry::global().create(b.optimizer, params, lr_only());
      const c10::IValue before = functional->state_dict();
      Outcome o = attempt([&] { functional->load_state_dict(h.state_dict); });
      tally.judge("functional " + b.name, h, o);
      if (o.threw) {  // nothing changed
        EXPECT_EQ(functional->state_dict().toGenericDict().at("state").toGenericDict().size(),
                  before.toGenericDict().at("state").toGenericDict().size())
            << h.label;
      } else {
        expect_option_after(functional->state_dict(), h, "functional " + b.name);
        std::vector<at::Tensor> grads;
        for (const auto& p : params) grads.push_back(at::ones_like(p));
        functional->step(grads);
        expect_finite_after(params, h, "functional " + b.name);
      }

      // The same variant as a checksum-valid file (save_state's zip, CRCs and all), loaded as
      // examples:train resumes: load_state, then load_state_dict.
      std::vector<at::Tensor> file_params = fresh(b.model);
      auto from_file = FunctionalRegistry::global().create(b.optimizer, file_params, lr_only());
      const std::string path = file_dir() + "/hostile.pt";
      if (checkpoint::save_state(path, h.state_dict).ok()) {
        Outcome f = attempt([&] {
          absl::StatusOr<c10::IValue> back = checkpoint::load_state(path);
          TORCH_CHECK(back.ok(), back.status().ToString());
          from_file->load_state_dict(*back);
        });
        tally.judge("file " + b.name, h, f);
        ++files;
        if (!f.threw) expect_option_after(from_file->state_dict(), h, "file " + b.name);
      } else {
        ++unwritable;  // save_state writes dense tensors only (a sparse exp_avg)
      }

      std::vector<at::Tensor> adapter_params = fresh(b.model);
      FunctionalOptimizerAdapter adapter(adapter_params, b.optimizer, lr_only());
      Outcome a = attempt([&] { adapter.load_state_dict(h.state_dict); });
      tally.judge("adapter " + b.name, h, a);
      if (!a.threw) {
        expect_option_after(adapter.state_dict(), h, "adapter " + b.name);
        for (auto& p : adapter_params) p.mutable_grad() = at::ones_like(p);
        adapter.step();
        expect_finite_after(adapter_params, h, "adapter " + b.name);
      }
    }
  }
  tally.print("(functional optimizers from memory and from files, and the adapter)");
  std::printf("campaign: %d of them checksum-valid files (%d variants save_state cannot write)\n",
              files, unwritable);
  EXPECT_GE(files, 500);
  EXPECT_EQ(tally.failures, 0);
  EXPECT_GE(optimizers.size(), 7u);  // Adam, AdamW, SGD, RMSprop, Adagrad, Adafactor, Muon
  EXPECT_GE(tally.total, 120);
}

// ZeroRedundancyOptimizer at world size 2: each rank owns part of the parameters, but both check
// the whole dict, so both refuse every hostile dict with the same message.
TEST_F(Campaign, ZeroRedundancyOptimizerRefusesEveryHostileStateDictOnEveryRank) {
  Tally tally;
  for (const Base& b : *bases_) {
    if (b.name != "adam" && b.name != "sgd_momentum" && b.name != "adafactor" && b.name != "muon")
      continue;
    const std::vector<Hostile> variants =
        hostile_variants(b.state_dict, b.model, b.optimizer, b.missing_options);
    std::vector<PartitionStrategy> strategies = {PartitionStrategy::kSortedGreedy};
    if (b.name == "adam") strategies.push_back(PartitionStrategy::kFlat);
    for (PartitionStrategy strategy : strategies) {
      std::vector<std::vector<Outcome>> outcomes(2);
      comm::testing::run_ranks_as_threads(2, [&](comm::Group& g) {
        ZeroOptions zo;
        zo.group = g;
        zo.strategy = strategy;
        std::vector<at::Tensor> params = fresh(b.model);
        ZeroRedundancyOptimizer zero(
            params, local_optimizer<FunctionalOptimizerAdapter>(b.optimizer, lr_only()), zo);
        for (const Hostile& h : variants) {
          outcomes[static_cast<size_t>(g.rank())].push_back(
              attempt([&] { zero.load_state_dict(h.state_dict); }));
        }
      });
      const std::string target =
          std::string("ZeRO ") + (strategy == PartitionStrategy::kFlat ? "flat " : "") + b.name;
      for (size_t k = 0; k < variants.size(); ++k) {
        for (int rank = 0; rank < 2; ++rank) {
          tally.judge(target + " rank " + std::to_string(rank), variants[k], outcomes[rank][k]);
        }
        EXPECT_EQ(outcomes[0][k].message, outcomes[1][k].message)
            << target << " / " << variants[k].label << ": the ranks disagree";
      }
    }
  }
  tally.print("(ZeroRedundancyOptimizer, both ranks)");
  EXPECT_EQ(tally.failures, 0);
  EXPECT_GE(tally.total, 120);
}

}  // namespace
}  // namespace dtrain::optim
