#include "optim/functional/registry.h"

#include <atomic>
#include <functional>
#include <thread>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "optim/functional/optimizers.h"
#include "optim/functional/testing/qhm.h"
#include "optim/functional/testing/reference.h"
#include "testing/test_util.h"

namespace dtrain::optim {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

using testing::FunctionalQHM;
using testing::register_qhm;
using testing::TorchQHM;

TEST(RegistryTest, UserQHMThroughTheRegistryMatchesPyTorch) {
  register_qhm();
  for (const auto& c : testing::read_reference("optim/functional/testdata/qhm.ref")) {
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
        for (size_t i = 0; i < params.size(); ++i)
          worst = std::max(worst, testing::relative_error(params[i], want[i]));
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
  for (const char* name : {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop",
                           "Rprop", "NAdam", "RAdam", "ASGD", "Adafactor", "SparseAdam", "Muon"}) {
    EXPECT_TRUE(r.contains(name)) << name;
  }
  EXPECT_TRUE(r.has_twin<torch::optim::Adam>());
  EXPECT_TRUE(r.has_twin<torch::optim::SGD>());
  std::vector<at::Tensor> p = {at::zeros({2})};
  auto adam = r.create<torch::optim::Adam>(
      p, options_from_torch(torch::optim::AdamOptions(0.05).betas({0.8, 0.9})));
  ASSERT_NE(dynamic_cast<FunctionalAdam*>(adam.get()), nullptr);
  EXPECT_EQ(adam->lr(), 0.05);
  auto betas = adam->options_dict().at("betas").toTupleRef().elements();
  EXPECT_EQ(betas[0].toDouble(), 0.8);
  auto sgd = r.create<torch::optim::SGD>(
      p, options_from_torch(torch::optim::SGDOptions(0.3).momentum(0.9)));
  EXPECT_EQ(sgd->name(), "SGD");
  EXPECT_EQ(sgd->options_dict().at("momentum").toDouble(), 0.9);
}

// PyTorch's functional Adamax (what DistributedOptimizer and ZeRO's functional path build) defaults
// lr to 1e-3; torch.optim.Adamax, like AdamaxOptions(), to 2e-3.
TEST(RegistryTest, AdamaxFromTheRegistryHasTheFunctionalDefaultLr) {
  std::vector<at::Tensor> p = {at::zeros({2})};
  auto adamax = FunctionalRegistry::global().create("Adamax", p, new_options_dict());
  EXPECT_EQ(adamax->lr(), 1e-3);
  EXPECT_EQ(adamax->options_dict().at("lr").toDouble(), 1e-3);
  EXPECT_EQ(FunctionalAdamax(p, AdamaxOptions()).lr(), 2e-3);
  OptionsDict o = new_options_dict();
  o.insert("lr", 0.5);
  EXPECT_EQ(FunctionalRegistry::global().create("Adamax", p, o)->lr(), 0.5);
}

using test_util::expect_error;

// PyTorch's functional optimizers refuse an empty parameter list unless _allow_empty_param_list.
TEST(RegistryTest, EmptyParameterListNeedsAllowEmptyParamList) {
  expect_error([] { FunctionalAdam({}, AdamOptions()); }, "optimizer got an empty parameter list");
  expect_error([] { FunctionalSGD({}, SGDOptions(0.1)); }, "optimizer got an empty parameter list");
  FunctionalAdam empty({}, AdamOptions(), /*allow_empty_param_list=*/true);
  empty.step({});
  EXPECT_EQ(empty.state_dict().toGenericDict().at("state").toGenericDict().size(), 0u);
  for (const char* name : {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop",
                           "Rprop", "NAdam", "RAdam", "ASGD", "Adafactor", "SparseAdam", "Muon"}) {
    SCOPED_TRACE(name);
    OptionsDict o = new_options_dict();
    o.insert("lr", 0.1);
    expect_error([&] { FunctionalRegistry::global().create(name, {}, o); },
                 "optimizer got an empty parameter list");
    o.insert(kAllowEmptyParamList, true);
    auto opt = FunctionalRegistry::global().create(name, {}, o);
    opt->step({});
    // A constructor argument, not an option: not in the param group, refused by set_options.
    EXPECT_FALSE(opt->options_dict().contains(kAllowEmptyParamList));
    OptionsDict again = new_options_dict();
    again.insert(kAllowEmptyParamList, true);
    expect_error([&] { opt->set_options(again); },
                 "got an unexpected option '_allow_empty_param_list'");
    // And it asks for nothing when there are parameters.
    std::vector<at::Tensor> p = {at::zeros({2, 2})};  // 2-D: Muon takes no other
    EXPECT_EQ(FunctionalRegistry::global().create(name, p, o)->params().size(), 1u);
  }
}

// Lookups of a twin's name while another thread re-registers it: each lookup copies the name under
// the lock (a pointer into the map could dangle; --config=asan reports that as a use after free).
TEST(RegistryTest, TwinLookupsRaceWithRegistration) {
  FunctionalRegistry r;
  r.register_optimizer("A", [](std::vector<at::Tensor> p, const OptionsDict&) {
    return std::unique_ptr<FunctionalOptimizer>(
        std::make_unique<FunctionalSGD>(std::move(p), SGDOptions(0.1)));
  });
  r.register_optimizer("BB_a_name_longer_than_the_small_string_buffer",
                       [](std::vector<at::Tensor> p, const OptionsDict&) {
                         return std::unique_ptr<FunctionalOptimizer>(
                             std::make_unique<FunctionalSGD>(std::move(p), SGDOptions(0.1)));
                       });
  std::atomic<bool> stop{false};
  std::atomic<int64_t> seen{0};
  std::thread writer([&] {
    // Start writing only once the reader has made a lookup, so the two overlap however the threads
    // are scheduled (on a loaded 2-core machine the writer could otherwise finish first).
    while (seen == 0) std::this_thread::yield();
    for (int i = 0; i < 20000; ++i) {
      if (i % 2 == 0) {
        r.register_twin<torch::optim::SGD>("A");
      } else {
        r.register_twin<torch::optim::SGD>("BB_a_name_longer_than_the_small_string_buffer");
      }
    }
    stop = true;
  });
  do {
    const std::string name = r.name_of<torch::optim::SGD>();
    EXPECT_TRUE(name.empty() || name == "A" ||
                name == "BB_a_name_longer_than_the_small_string_buffer")
        << name;
    ++seen;
  } while (!stop);
  writer.join();
}

TEST(RegistryTest, ClearErrors) {
  auto& r = FunctionalRegistry::global();
  std::vector<at::Tensor> p = {at::zeros({2})};
  try {
    r.create("Lion", p, new_options_dict());
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("no functional optimizer named 'Lion' is registered (known: "));
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

// Which optimizers need whole parameters is the optimizer's own fact (its descriptor), read
// through the registry by ZeroRedundancyOptimizer; replacing a built-in clears it.
TEST(RegistryTest, WholeParameterOptimizers) {
  FunctionalRegistry& r = FunctionalRegistry::global();
  for (const std::string& name : r.names()) {
    EXPECT_EQ(r.needs_whole_parameters(name), name == "Adafactor" || name == "Muon") << name;
  }
  EXPECT_FALSE(r.needs_whole_parameters("NoSuchOptimizer"));
  r.register_optimizer("WholeForTest", [](std::vector<at::Tensor>, const OptionsDict&) {
    return std::unique_ptr<FunctionalOptimizer>();
  });
  EXPECT_FALSE(r.needs_whole_parameters("WholeForTest"));
  r.set_whole_parameters("WholeForTest", true);
  EXPECT_TRUE(r.needs_whole_parameters("WholeForTest"));
  r.register_optimizer("WholeForTest", [](std::vector<at::Tensor>, const OptionsDict&) {
    return std::unique_ptr<FunctionalOptimizer>();
  });
  EXPECT_FALSE(r.needs_whole_parameters("WholeForTest"));
}

}  // namespace
}  // namespace dtrain::optim
