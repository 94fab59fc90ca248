#include "optim/functional/adapter.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "optim/functional/registry.h"

namespace dtrain::optim {
namespace {

using ::testing::HasSubstr;

OptionsDict opts(std::initializer_list<std::pair<const char*, c10::IValue>> kv) {
  OptionsDict d = new_options_dict();
  for (const auto& [k, v] : kv) d.insert(k, v);
  return d;
}

// A small regression trained with the adapter and with torch::optim::Adam must agree.
TEST(FunctionalAdapterTest, TrainsLikeTorchOptimAdam) {
  torch::manual_seed(0);
  torch::nn::Linear a(4, 3), b(4, 3);
  b->weight.data().copy_(a->weight.data());
  b->bias.data().copy_(a->bias.data());
  FunctionalOptimizerAdapter ours(a->parameters(), "Adam",
                                  opts({{"lr", 0.01}, {"weight_decay", 0.1}}));
  torch::optim::Adam theirs(b->parameters(), torch::optim::AdamOptions(0.01).weight_decay(0.1));
  at::Tensor x = torch::randn({16, 4}), y = torch::randn({16, 3});
  for (int step = 0; step < 20; ++step) {
    at::Tensor loss_a = ours.step([&] {
      ours.zero_grad();
      at::Tensor l = torch::mse_loss(a(x), y);
      l.backward();
      return l;
    });
    theirs.zero_grad();
    at::Tensor loss_b = torch::mse_loss(b(x), y);
    loss_b.backward();
    theirs.step();
    EXPECT_NEAR(loss_a.item<double>(), loss_b.item<double>(), 1e-5) << step;
  }
  EXPECT_TRUE(a->weight.allclose(b->weight, 1e-5, 1e-6));
}

TEST(FunctionalAdapterTest, ParamGroupsSchedulersAndNewGroups) {
  at::Tensor w = torch::zeros({2}, torch::requires_grad()),
             v = torch::zeros({2}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{w});
  groups.emplace_back(std::vector<at::Tensor>{v},
                      std::make_unique<DictOptions>(opts({{"lr", 0.5}})));
  FunctionalOptimizerAdapter sgd(std::move(groups), "SGD", opts({{"lr", 1.0}}));
  w.mutable_grad() = torch::ones({2});
  v.mutable_grad() = torch::ones({2});
  sgd.step();
  EXPECT_TRUE(w.allclose(torch::full({2}, -1.0)));
  EXPECT_TRUE(v.allclose(torch::full({2}, -0.5)));
  // A scheduler's set_lr reaches the functional optimizer.
  sgd.param_groups()[0].options().set_lr(0.25);
  sgd.step();
  EXPECT_TRUE(w.allclose(torch::full({2}, -1.25)));
  EXPECT_EQ(sgd.functional(0).lr(), 0.25);
  // A group added later gets its own functional optimizer.
  at::Tensor u = torch::zeros({3}, torch::requires_grad());
  sgd.add_param_group(torch::optim::OptimizerParamGroup({u}));
  u.mutable_grad() = torch::ones({3});
  sgd.step();
  EXPECT_TRUE(u.allclose(torch::full({3}, -1.0)));
  // Parameters without gradients are skipped.
  at::Tensor before = w.detach().clone();
  sgd.zero_grad();
  w.mutable_grad() = at::Tensor();
  sgd.step();
  EXPECT_TRUE(w.equal(before));
}

TEST(FunctionalAdapterTest, StateDictUsesGlobalIndices) {
  at::Tensor w = torch::zeros({2}, torch::requires_grad()),
             v = torch::zeros({3}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{w});
  groups.emplace_back(std::vector<at::Tensor>{v});
  FunctionalOptimizerAdapter adam(std::move(groups), "Adam", opts({{"lr", 0.1}}));
  w.mutable_grad() = torch::ones({2});
  v.mutable_grad() = torch::ones({3});
  adam.step();
  auto sd = adam.state_dict();
  auto state = sd.toGenericDict().at("state").toGenericDict();
  ASSERT_TRUE(state.contains(static_cast<int64_t>(1)));
  EXPECT_EQ(state.at(static_cast<int64_t>(1)).toGenericDict().at("exp_avg").toTensor().numel(), 3);
  auto g1 = sd.toGenericDict().at("param_groups").toList().get(1).toGenericDict();
  EXPECT_EQ(g1.at("params").toList().get(0).toInt(), 1);
  // Load into a fresh adapter and continue identically.
  at::Tensor w2 = w.detach().clone().requires_grad_(), v2 = v.detach().clone().requires_grad_();
  std::vector<torch::optim::OptimizerParamGroup> groups2;
  groups2.emplace_back(std::vector<at::Tensor>{w2});
  groups2.emplace_back(std::vector<at::Tensor>{v2});
  FunctionalOptimizerAdapter adam2(std::move(groups2), "Adam", opts({{"lr", 0.7}}));
  adam2.load_state_dict(sd);
  EXPECT_EQ(adam2.param_groups()[1].options().get_lr(), 0.1);
  w2.mutable_grad() = torch::ones({2});
  v2.mutable_grad() = torch::ones({3});
  adam.step();
  adam2.step();
  EXPECT_TRUE(w.equal(w2));
  EXPECT_TRUE(v.equal(v2));
}

TEST(FunctionalAdapterTest, BadConstructionIsAClearError) {
  std::vector<at::Tensor> p = {torch::zeros({1}, torch::requires_grad())};
  try {
    FunctionalOptimizerAdapter x(p, "Nope", new_options_dict());
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("no functional optimizer named 'Nope'"));
  }
  try {
    FunctionalOptimizerAdapter x(p, "Adam", opts({{"lr", -1.0}}));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("Invalid learning rate: -1.0"));
  }
}

// PyTorch keeps param-group keys an optimizer does not use (an LR scheduler's initial_lr, 2.x's
// foreach, a user's own) and returns them in state_dict(); so do the functional optimizer and the
// adapter. set_options() still refuses a key it does not know.
// A LibTorch optimizer accepts empty param groups (ZeRO gives a rank that owns no parameter
// one): the adapter asks the functional optimizer for _allow_empty_param_list, as PyTorch's ZeRO does.
TEST(FunctionalAdapterTest, EmptyParamGroupsAreAccepted) {
  at::Tensor w = torch::ones({2}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups = {
      torch::optim::OptimizerParamGroup(std::vector<at::Tensor>{}),
      torch::optim::OptimizerParamGroup({w})};
  FunctionalOptimizerAdapter opt(groups, "Adam", opts({{"lr", 0.1}}));
  EXPECT_EQ(opt.functional(0).params().size(), 0u);
  w.mutable_grad() = torch::ones({2});
  opt.step();
  EXPECT_FALSE(w.equal(torch::ones({2})));
  EXPECT_FALSE(opt.functional(0).options_dict().contains(kAllowEmptyParamList));
  FunctionalOptimizerAdapter none(std::vector<at::Tensor>{}, "SGD", opts({{"lr", 0.1}}));
  none.step();
  EXPECT_EQ(none.state_dict().toGenericDict().at("param_groups").toList().size(), 1u);
}

TEST(FunctionalAdapterTest, UnknownParamGroupKeysAreKept) {
  at::Tensor w = torch::zeros({2}, torch::requires_grad());
  FunctionalOptimizerAdapter opt({w}, "Adam", opts({{"lr", 0.01}}));
  w.mutable_grad() = torch::ones({2});
  opt.step();
  auto sd = opt.state_dict().toGenericDict();
  auto group = sd.at("param_groups").toList().get(0).toGenericDict();
  group.insert_or_assign("initial_lr", 0.01);
  group.insert_or_assign("foreach", c10::IValue());
  group.insert_or_assign("my_tag", std::string("warmup"));
  group.insert_or_assign("lr", 0.005);

  at::Tensor w2 = torch::zeros({2}, torch::requires_grad());
  FunctionalOptimizerAdapter other({w2}, "Adam", opts({{"lr", 0.01}}));
  other.load_state_dict(sd);
  auto back = other.state_dict().toGenericDict().at("param_groups").toList().get(0).toGenericDict();
  EXPECT_EQ(back.at("lr").toDouble(), 0.005);
  ASSERT_TRUE(back.contains("initial_lr"));
  EXPECT_EQ(back.at("initial_lr").toDouble(), 0.01);
  ASSERT_TRUE(back.contains("foreach"));
  EXPECT_TRUE(back.at("foreach").isNone());
  ASSERT_TRUE(back.contains("my_tag"));
  EXPECT_EQ(back.at("my_tag").toStringRef(), "warmup");

  std::unique_ptr<FunctionalOptimizer> f =
      FunctionalRegistry::global().create("Adam", {w2}, opts({{"lr", 0.01}}));
  try {
    f->set_options(opts({{"initial_lr", 0.01}}));
    ADD_FAILURE() << "set_options accepted an unknown key";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("unexpected option 'initial_lr'"));
  }
}

// torch.optim's newer optimizers through the adapter, as a LibTorch loop uses them: SparseAdam on
// a sparse embedding (its .grad() is sparse COO; rows no batch touches stay as they were), Muon on
// the 2-D weight of the layer after it, NAdam on that layer's bias.
TEST(FunctionalAdapterTest, SparseEmbeddingWithSparseAdamAndMuonAndNAdam) {
  torch::manual_seed(0);
  torch::nn::Embedding embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true));
  torch::nn::Linear linear(4, 3);
  FunctionalOptimizerAdapter sparse_adam(embedding->parameters(), "SparseAdam",
                                         opts({{"lr", 0.05}}));
  FunctionalOptimizerAdapter muon({linear->weight}, "Muon", opts({{"lr", 0.05}}));
  FunctionalOptimizerAdapter nadam({linear->bias}, "NAdam", opts({{"lr", 0.05}}));
  const at::Tensor ids = torch::tensor({1, 3, 3, 7}, torch::kLong);
  const at::Tensor target = torch::randn({4, 3});
  const at::Tensor untouched =
      embedding->weight.detach().index_select(0, torch::tensor({0, 2, 9})).clone();
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    for (auto* opt : {&sparse_adam, &muon, &nadam}) opt->zero_grad();
    at::Tensor loss = torch::mse_loss(linear(embedding(ids)), target);
    loss.backward();
    ASSERT_TRUE(embedding->weight.grad().is_sparse());
    for (auto* opt : {&sparse_adam, &muon, &nadam}) opt->step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first * 0.5);
  EXPECT_TRUE(
      embedding->weight.detach().index_select(0, torch::tensor({0, 2, 9})).equal(untouched));
}

// A bad entry in the second group is refused naming its index in the dict (across the groups),
// not its index inside the group, and no group changes, the first one included.
TEST(FunctionalAdapterTest, LoadNamesTheDictsIndexAndChangesNoGroupOnError) {
  std::vector<at::Tensor> a = {torch::zeros({2}), torch::zeros({3})}, b = {torch::zeros({4})};
  std::vector<torch::optim::OptimizerParamGroup> groups = {torch::optim::OptimizerParamGroup(a),
                                                           torch::optim::OptimizerParamGroup(b)};
  FunctionalOptimizerAdapter adam(groups, "Adam", opts({{"lr", 0.1}}));
  for (auto& p : a) p.mutable_grad() = torch::ones_like(p);
  for (auto& p : b) p.mutable_grad() = torch::ones_like(p);
  adam.step();
  c10::IValue sd = adam.state_dict();
  FunctionalOptimizerAdapter fresh(groups, "Adam", opts({{"lr", 0.1}}));
  c10::IValue bad = sd.deepcopy();
  bad.toGenericDict().at("state").toGenericDict().at(2).toGenericDict().insert_or_assign(
      "exp_avg", torch::full({4}, NAN));
  try {
    fresh.load_state_dict(bad);
    FAIL() << "a NaN exp_avg was accepted";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("Adam.load_state_dict: state 'exp_avg' of parameter 2 holds nan"));
  }
  EXPECT_FALSE(fresh.functional(0).has_state(0));
  // And with the file's indices given (ZeroRedundancyOptimizer's local parameters).
  try {
    fresh.load_state_dict(bad, {10, 11, 12});
    FAIL() << "a NaN exp_avg was accepted";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("'exp_avg' of parameter 12 holds nan"));
  }
  c10::IValue duplicated = sd.deepcopy();
  duplicated.toGenericDict()
      .at("param_groups")
      .toList()
      .get(1)
      .toGenericDict()
      .insert_or_assign("params", c10::List<int64_t>({0}));
  try {
    fresh.load_state_dict(duplicated);
    FAIL() << "parameter 0 listed twice was accepted";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("parameter 0 is listed twice"));
  }
  fresh.load_state_dict(sd);
  EXPECT_TRUE(fresh.functional(1).has_state(0));
}

}  // namespace
}  // namespace dtrain::optim
