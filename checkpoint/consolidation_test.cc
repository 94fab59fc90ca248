#include "checkpoint/consolidation.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"
#include "partition/sorted_greedy.h"

namespace dtrain::checkpoint {
namespace {

using ::testing::HasSubstr;

using Dict = c10::impl::GenericDict;

Dict new_dict(c10::TypePtr key) { return Dict(std::move(key), c10::AnyType::get()); }

// The state an unsharded Adam-like optimizer would have for 7 parameters of varied sizes and
// dtypes, plus non-tensor entries (int step, None).
Dict global_state() {
  at::manual_seed(7);
  Dict state = new_dict(c10::IntType::get());
  const std::vector<std::vector<int64_t>> shapes = {{300},     {4, 5}, {1}, {1000},
                                                    {3, 3, 3}, {17},   {2}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    Dict e = new_dict(c10::StringType::get());
    e.insert("step", at::scalar_tensor(static_cast<double>(i + 1), at::kFloat));
    e.insert("exp_avg", at::randn(shapes[i]));
    e.insert("exp_avg_sq", at::rand(shapes[i], at::kDouble));
    if (i % 3 == 0) e.insert("counts", at::randint(0, 100, shapes[i], at::kLong));
    if (i == 2) e.insert("momentum_buffer", c10::IValue());
    e.insert("int_step", static_cast<int64_t>(10 * i));
    state.insert(static_cast<int64_t>(i), e);
  }
  return state;
}

Dict groups_dict(const std::vector<int64_t>& params, double lr) {
  Dict g = new_dict(c10::StringType::get());
  g.insert("lr", lr);
  g.insert("params", c10::List<int64_t>(params));
  return g;
}

// This rank's part: the entries of the parameters sorted-greedy assigns to it.
c10::IValue local_part(const Dict& global, int rank, int world) {
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < static_cast<int64_t>(global.size()); ++i) {
    sizes.push_back(global.at(i).toGenericDict().at("exp_avg").toTensor().numel());
  }
  auto p = partition::sorted_greedy_partition({sizes}, world);
  Dict state = new_dict(c10::IntType::get());
  for (int64_t i : p->params_per_rank[rank][0]) state.insert(i, global.at(i));
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(groups_dict(p->params_per_rank[rank][0], 0.1 * (rank + 1)));
  Dict sd = new_dict(c10::StringType::get());
  sd.insert("state", state);
  sd.insert("param_groups", groups);
  return sd;
}

void expect_equal_state(const Dict& got, const Dict& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& kv : want) {
    ASSERT_TRUE(got.contains(kv.key())) << kv.key().toInt();
    auto g = got.at(kv.key()).toGenericDict();
    auto w = kv.value().toGenericDict();
    ASSERT_EQ(g.size(), w.size()) << "param " << kv.key().toInt();
    for (const auto& e : w) {
      const c10::IValue& gv = g.at(e.key());
      if (e.value().isTensor()) {
        ASSERT_TRUE(gv.isTensor());
        EXPECT_EQ(gv.toTensor().scalar_type(), e.value().toTensor().scalar_type());
        EXPECT_TRUE(gv.toTensor().equal(e.value().toTensor()))
            << kv.key().toInt() << " " << e.key().toStringRef();
      } else {
        EXPECT_EQ(gv, e.value()) << kv.key().toInt() << " " << e.key().toStringRef();
      }
    }
  }
}

void check_world(int world, int64_t chunk_bytes) {
  // Drawn once, here: rank threads would race on the global generator.
  const Dict global = global_state();
  comm::testing::run_ranks_as_threads(world, [=](comm::Group& g) {
    ConsolidateOptions o;
    o.chunk_bytes = chunk_bytes;
    const int to = world - 1;
    auto full = consolidate_state_dict(g, local_part(global, g.rank(), world), to, o);
    ASSERT_TRUE(full.ok()) << full.status();
    if (g.rank() != to) {
      EXPECT_TRUE(full->isNone());
      return;
    }
    auto sd = full->toGenericDict();
    expect_equal_state(sd.at("state").toGenericDict(), global);
    // State comes back in index order, as PyTorch's consolidated state_dict.
    int64_t last = -1;
    for (const auto& kv : sd.at("state").toGenericDict()) {
      EXPECT_GT(kv.key().toInt(), last);
      last = kv.key().toInt();
    }
    auto group = sd.at("param_groups").toList().get(0).toGenericDict();
    EXPECT_EQ(group.at("params").toIntVector(), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
    EXPECT_DOUBLE_EQ(group.at("lr").toDouble(), 0.1 * world);  // options of the target
  });
}

TEST(ConsolidationTest, EqualsUnshardedStateWorld2) { check_world(2, int64_t{16} << 20); }
TEST(ConsolidationTest, EqualsUnshardedStateWorld3SmallChunks) { check_world(3, 100); }

// State as a model may hold it: complex with its conjugate bit set (its values are not its
// memory), transposed, requiring grad, bool, half. The target gets plain CPU tensors equal to it.
TEST(ConsolidationTest, ConjugatedTransposedAndOtherDtypes) {
  at::manual_seed(3);
  Dict entry = new_dict(c10::StringType::get());
  entry.insert("conj", at::randn({3, 4}, at::kComplexFloat).conj());
  entry.insert("transposed", at::randn({4, 5}).t());
  entry.insert("grad", at::randn({5}).requires_grad_());
  entry.insert("mask", at::rand({6}).gt(0.5));
  entry.insert("half", at::randn({7}).to(at::kHalf));
  comm::testing::run_ranks_as_threads(2, [=](comm::Group& g) {
    Dict state = new_dict(c10::IntType::get());
    if (g.rank() == 1) state.insert(int64_t{0}, entry);  // sent to rank 0
    c10::impl::GenericList groups(c10::AnyType::get());
    groups.push_back(
        groups_dict(g.rank() == 1 ? std::vector<int64_t>{0} : std::vector<int64_t>{}, 0.1));
    Dict sd = new_dict(c10::StringType::get());
    sd.insert("state", state);
    sd.insert("param_groups", groups);
    ConsolidateOptions o;
    o.chunk_bytes = 12;  // several pieces per tensor
    auto full = consolidate_state_dict(g, sd, 0, o);
    ASSERT_TRUE(full.ok()) << full.status();
    if (g.rank() != 0) return;
    const Dict got =
        full->toGenericDict().at("state").toGenericDict().at(int64_t{0}).toGenericDict();
    for (const auto& kv : entry) {
      const at::Tensor want = kv.value().toTensor().detach().resolve_conj();
      const at::Tensor t = got.at(kv.key()).toTensor();
      EXPECT_TRUE(t.device().is_cpu() && !t.is_conj()) << kv.key().toStringRef();
      EXPECT_EQ(t.scalar_type(), want.scalar_type()) << kv.key().toStringRef();
      EXPECT_TRUE(t.equal(want)) << kv.key().toStringRef();
    }
  });
}

TEST(ConsolidationTest, DuplicateStateFailsOnEveryRank) {
  const Dict global = global_state();
  comm::testing::run_ranks_as_threads(2, [=](comm::Group& g) {
    // Both ranks claim everything.
    Dict sd = new_dict(c10::StringType::get());
    sd.insert("state", global);
    c10::impl::GenericList groups(c10::AnyType::get());
    groups.push_back(groups_dict({0, 1, 2, 3, 4, 5, 6}, 0.1));
    sd.insert("param_groups", groups);
    auto full = consolidate_state_dict(g, sd, 0);
    EXPECT_EQ(full.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(full.status().message()),
                HasSubstr("state of parameter 0 is held by both rank 0 and rank 1"));
  });
}

TEST(ConsolidationTest, BadArguments) {
  comm::testing::run_ranks_as_threads(2, [](comm::Group& g) {
    EXPECT_THAT(std::string(consolidate_state_dict(g, c10::IValue(1), 5).status().message()),
                HasSubstr("to=5 is not a rank of this group of 2"));
    EXPECT_THAT(std::string(consolidate_state_dict(g, c10::IValue(1), 0).status().message()),
                HasSubstr("the local state dict is not a dict"));
  });
}

}  // namespace
}  // namespace dtrain::checkpoint
