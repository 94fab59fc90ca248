#include "checkpoint/optimizer_state_dict.h"
#include "testing/test_util.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace dtrain::checkpoint {
namespace {

using ::testing::HasSubstr;
using Dict = c10::impl::GenericDict;

using test_util::str_dict;

// What PyTorch's Adam.state_dict() returns for two groups: {0: ..., 2: ...} of state.
c10::IValue adam_like() {
  Dict state(c10::IntType::get(), c10::AnyType::get());
  for (int64_t i : {2, 0}) {  // insertion order not ascending: emit sorts
    Dict e = str_dict();
    e.insert("step", at::scalar_tensor(3.0, at::kFloat));
    e.insert("exp_avg", at::full({2}, static_cast<double>(i)));
    e.insert("exp_avg_sq", at::full({2}, 1.0));
    state.insert(i, e);
  }
  c10::impl::GenericList groups(c10::AnyType::get());
  for (int g = 0; g < 2; ++g) {
    Dict d = str_dict();
    d.insert("lr", 0.1 * (g + 1));
    d.insert("params",
             c10::List<int64_t>(g == 0 ? std::vector<int64_t>{0, 1} : std::vector<int64_t>{2}));
    d.insert("initial_lr", 0.5);  // after "params": kept, emitted before it
    groups.push_back(d);
  }
  Dict sd = str_dict();
  sd.insert("state", state);
  sd.insert("param_groups", groups);
  return sd;
}

std::vector<std::string> keys(const Dict& d) {
  std::vector<std::string> out;
  for (const auto& kv : d) out.push_back(kv.key().toStringRef());
  return out;
}

TEST(OptimizerStateDictTest, ParseKeepsEverythingAndEmitsPyTorchsOrder) {
  auto sd = parse_optimizer_state_dict(adam_like(), "the state dict");
  ASSERT_TRUE(sd.ok()) << sd.status();
  ASSERT_EQ(sd->state.size(), 2u);
  ASSERT_EQ(sd->param_groups.size(), 2u);
  EXPECT_EQ(sd->param_groups[0].params, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(keys(sd->param_groups[1].options), (std::vector<std::string>{"lr", "initial_lr"}));
  EXPECT_EQ(keys(sd->state.at(2)), (std::vector<std::string>{"step", "exp_avg", "exp_avg_sq"}));

  const c10::IValue out = to_ivalue(*sd);
  const Dict top = out.toGenericDict();
  EXPECT_EQ(keys(top), (std::vector<std::string>{"state", "param_groups"}));
  std::vector<int64_t> order;
  for (const auto& kv : top.at("state").toGenericDict()) order.push_back(kv.key().toInt());
  EXPECT_EQ(order, (std::vector<int64_t>{0, 2}));
  const Dict g1 = top.at("param_groups").toList().get(1).toGenericDict();
  EXPECT_EQ(keys(g1), (std::vector<std::string>{"lr", "initial_lr", "params"}));
  EXPECT_TRUE(g1.at("params").isIntList());
  EXPECT_EQ(state_tensor_bytes(*sd),
            2 * 2 * (2 * 4) + 2 * 4);  // 2 entries: 2 float[2], a 0-dim step

  // Round trip: parsing the emitted dict gives the same dict back.
  auto again = parse_optimizer_state_dict(out, "x");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(to_ivalue(*again), out);
}

TEST(OptimizerStateDictTest, AnyTypedListsAndDictsAsPythonsLoadGivesThem) {
  Dict group(c10::AnyType::get(), c10::AnyType::get());
  c10::impl::GenericList params(c10::AnyType::get());
  params.push_back(int64_t{4});
  group.insert("params", params);
  group.insert("lr", 1.0);
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(group);
  Dict sd(c10::AnyType::get(), c10::AnyType::get());
  sd.insert("state", Dict(c10::AnyType::get(), c10::AnyType::get()));
  sd.insert("param_groups", groups);
  auto parsed = parse_optimizer_state_dict(sd, "file");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->param_groups[0].params, (std::vector<int64_t>{4}));
  EXPECT_EQ(keys(parsed->param_groups[0].options), (std::vector<std::string>{"lr"}));
}

TEST(OptimizerStateDictTest, ErrorsNameWhatIsWrong) {
  auto message = [](const c10::IValue& v) {
    auto sd = parse_optimizer_state_dict(v, "the local state dict");
    EXPECT_EQ(sd.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(sd.status().message());
  };
  EXPECT_THAT(message(c10::IValue(int64_t{1})),
              HasSubstr("the local state dict is not a dict (got Int)"));
  EXPECT_THAT(message(str_dict()), HasSubstr("needs keys 'state' and 'param_groups'"));

  Dict bad_key = adam_like().toGenericDict().copy();
  Dict state(c10::AnyType::get(), c10::AnyType::get());
  state.insert("zero", str_dict());
  bad_key.insert_or_assign("state", state);
  EXPECT_THAT(message(bad_key),
              HasSubstr("the local state dict: state keys must be integer parameter indices"));

  Dict bad_entry = adam_like().toGenericDict().copy();
  Dict state2(c10::IntType::get(), c10::AnyType::get());
  state2.insert(int64_t{3}, int64_t{7});
  bad_entry.insert_or_assign("state", state2);
  EXPECT_THAT(message(bad_entry), HasSubstr("state[3] is not a dict"));

  Dict no_params = adam_like().toGenericDict().copy();
  c10::impl::GenericList groups(c10::AnyType::get());
  Dict g = str_dict();
  g.insert("lr", 0.1);
  groups.push_back(g);
  no_params.insert_or_assign("param_groups", groups);
  EXPECT_THAT(message(no_params), HasSubstr("param group 0 has no 'params'"));

  Dict not_list = adam_like().toGenericDict().copy();
  not_list.insert_or_assign("param_groups", int64_t{3});
  EXPECT_THAT(message(not_list), HasSubstr("'param_groups' is not a list"));
}

TEST(OptimizerStateDictTest, SliceConcatenateReindexAreInverse) {
  const OptimizerStateDict sd = *parse_optimizer_state_dict(adam_like(), "sd");
  const OptimizerStateDict g0 = group_slice(sd, 0), g1 = group_slice(sd, 1);
  EXPECT_EQ(g0.param_groups[0].params, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(g1.param_groups[0].params, (std::vector<int64_t>{0}));
  ASSERT_EQ(g1.state.count(0), 1u);  // parameter 2 is group 1's first
  EXPECT_TRUE(g1.state.at(0).at("exp_avg").toTensor().equal(at::full({2}, 2.0)));
  EXPECT_EQ(to_ivalue(concatenate({g0, g1})), to_ivalue(sd));

  const OptimizerStateDict moved = reindexed(sd, {10, 11, 12});
  EXPECT_EQ(moved.param_groups[0].params, (std::vector<int64_t>{10, 11}));
  EXPECT_EQ(moved.state.count(12), 1u);
  EXPECT_THROW(reindexed(sd, {0}), c10::Error);
}

TEST(OptimizerStateDictTest, MergeUnitesDisjointParts) {
  OptimizerStateDict a = *parse_optimizer_state_dict(adam_like(), "sd");
  OptimizerStateDict b;
  b.state.emplace(1, new_state_entry());
  b.param_groups = {ParamGroup{{1, 3}, new_state_entry()}, ParamGroup{{}, new_state_entry()}};
  auto m = merge({a, b}, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->state.size(), 3u);
  EXPECT_EQ(m->param_groups[0].params, (std::vector<int64_t>{0, 1, 3}));
  EXPECT_DOUBLE_EQ(m->param_groups[0].options.at("lr").toDouble(), 0.1);  // options of part 0

  b.state.emplace(2, new_state_entry());
  EXPECT_THAT(std::string(merge({a, b}, 0).status().message()),
              HasSubstr("state of parameter 2 is in both part 0 and part 1"));
  b.param_groups.pop_back();
  EXPECT_THAT(std::string(merge({a, b}, 0).status().message()),
              HasSubstr("part 1 has 1 param groups, part 0 has 2"));
}

}  // namespace
}  // namespace dtrain::checkpoint
