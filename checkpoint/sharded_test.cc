#include "checkpoint/sharded.h"

#include <dirent.h>
#include <unistd.h>

#include <fstream>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/test_harness.h"
#include "partition/flat_partition.h"
#include "partition/sorted_greedy.h"

namespace dtrain::checkpoint {
namespace {

using ::testing::HasSubstr;
using Dict = c10::impl::GenericDict;

const std::vector<std::vector<int64_t>> kShapes = {{40}, {6, 7}, {1}, {100}, {5, 5}};

std::vector<int64_t> numels() {
  std::vector<int64_t> n;
  for (const auto& s : kShapes) n.push_back(at::empty(s).numel());
  return n;
}

// The unsharded state: what one optimizer holding every parameter would have.
std::vector<Dict> global_state() {
  at::manual_seed(11);
  std::vector<Dict> out;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    Dict e(c10::StringType::get(), c10::AnyType::get());
    e.insert("step", at::scalar_tensor(static_cast<double>(i + 1), at::kFloat));
    e.insert("exp_avg", at::randn(kShapes[i]));
    e.insert("exp_avg_sq", at::rand(kShapes[i], at::kDouble));
    e.insert("int_step", static_cast<int64_t>(i * 3));
    out.push_back(e);
  }
  return out;
}

// Pieces (param -> element range) `rank` owns under a strategy at a world size.
std::map<int64_t, ElementRange> owned(const std::string& strategy, int world, int rank) {
  std::map<int64_t, ElementRange> out;
  const auto n = numels();
  if (strategy == "flat") {
    auto fp = partition::flat_partition(n, world, /*alignment=*/4);
    for (const auto& s : fp->slices[rank]) out[s.param_index] = {s.begin, s.end};
  } else {
    auto p = partition::sorted_greedy_partition({n}, world);
    for (int64_t i : p->params_per_rank[rank][0]) out[i] = {0, n[i]};
  }
  return out;
}

ShardedState shard_of(const std::vector<Dict>& global, const std::map<int64_t, ElementRange>& pieces) {
  ShardedState s;
  for (const auto& [i, r] : pieces) {
    ShardedState::Param p;
    p.shape = kShapes[i];
    p.range = r;
    const bool whole = r.begin == 0 && r.end == at::empty(kShapes[i]).numel();
    for (const auto& kv : global[i]) {
      const c10::IValue& v = kv.value();
      if (v.isTensor() && v.toTensor().dim() > 0 && !whole) {
        p.entries.insert(kv.key(), v.toTensor().reshape(-1).narrow(0, r.begin, r.size()).clone());
      } else {
        p.entries.insert(kv.key(), v);
      }
    }
    s.params[i] = p;
  }
  Dict extra(c10::StringType::get(), c10::AnyType::get());
  extra.insert("step", int64_t{500});
  s.extra = extra;
  return s;
}

std::string temp_dir() {
  char dir[] = "/tmp/dtrain_sharded_XXXXXX";
  EXPECT_NE(::mkdtemp(dir), nullptr);
  return dir;
}

void save_at(const std::string& dir, const std::string& strategy, int world) {
  // Drawn once, here: rank threads would race on the global generator.
  const auto global = global_state();
  comm::testing::run_ranks_as_threads(world, [&](comm::Group& g) {
    absl::Status s = save_sharded(g, dir, shard_of(global, owned(strategy, world, g.rank())), strategy);
    ASSERT_TRUE(s.ok()) << s;
  });
}

void expect_loads_at(const std::string& dir, const std::string& strategy, int world) {
  const auto global = global_state();
  for (int rank = 0; rank < world; ++rank) {
    const auto pieces = owned(strategy, world, rank);
    absl::StatusOr<ShardedState> got = load_sharded(dir, pieces);
    ASSERT_TRUE(got.ok()) << got.status();
    const ShardedState want = shard_of(global, pieces);
    ASSERT_EQ(got->params.size(), want.params.size());
    for (const auto& [i, p] : want.params) {
      const auto& q = got->params.at(i);
      for (const auto& kv : p.entries) {
        const c10::IValue& a = q.entries.at(kv.key());
        if (kv.value().isTensor()) {
          EXPECT_TRUE(a.toTensor().equal(kv.value().toTensor())) << "rank " << rank << " param " << i << " " << kv.key().toStringRef();
        } else {
          EXPECT_EQ(a, kv.value());
        }
      }
    }
    EXPECT_EQ(got->extra.toGenericDict().at("step").toInt(), 500);
  }
}

TEST(ShardedTest, ReshardsAcrossWorldSizesAndStrategies) {
  for (const std::string saved : {"sorted_greedy", "flat"}) {
    for (auto [from, to] : std::vector<std::pair<int, int>>{{2, 1}, {2, 3}, {3, 2}}) {
      for (const std::string loaded : {"sorted_greedy", "flat"}) {
        SCOPED_TRACE(saved + " " + std::to_string(from) + " -> " + loaded + " " + std::to_string(to));
        const std::string dir = temp_dir();
        save_at(dir, saved, from);
        auto info = read_sharded_info(dir);
        ASSERT_TRUE(info.ok()) << info.status();
        EXPECT_EQ(info->world_size, from);
        EXPECT_EQ(info->strategy, saved);
        expect_loads_at(dir, loaded, to);
      }
    }
  }
}

int count_shards(const std::string& dir) {
  int n = 0;
  DIR* d = ::opendir(dir.c_str());
  while (dirent* e = ::readdir(d)) n += std::string(e->d_name).rfind("shard-", 0) == 0;
  ::closedir(d);
  return n;
}

TEST(ShardedTest, NewSaveReplacesOldShards) {
  const std::string dir = temp_dir();
  save_at(dir, "flat", 3);
  EXPECT_EQ(count_shards(dir), 3);
  save_at(dir, "sorted_greedy", 2);
  EXPECT_EQ(count_shards(dir), 2);
  expect_loads_at(dir, "flat", 4);
}

TEST(ShardedTest, IncompleteAndCorruptCheckpoints) {
  const std::string dir = temp_dir();
  save_at(dir, "flat", 2);
  // A shard damaged on disk: the load names it.
  std::string shard;
  DIR* d = ::opendir(dir.c_str());
  while (dirent* e = ::readdir(d)) if (std::string(e->d_name).rfind("shard-", 0) == 0) shard = e->d_name;
  ::closedir(d);
  {
    std::fstream f(dir + "/" + shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.put('\x7f');
  }
  auto bad = load_sharded(dir, owned("flat", 1, 0));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("shard " + shard));
  // No commit marker: reported as an incomplete checkpoint.
  ASSERT_EQ(::unlink((dir + "/metadata.pt").c_str()), 0);
  auto incomplete = load_sharded(dir, owned("flat", 1, 0));
  EXPECT_EQ(incomplete.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(incomplete.status().message()), HasSubstr("incomplete checkpoint: " + dir));
  EXPECT_EQ(read_sharded_info(temp_dir()).status().code(), absl::StatusCode::kNotFound);
}

TEST(ShardedTest, BadRequests) {
  const std::string dir = temp_dir();
  save_at(dir, "sorted_greedy", 2);
  EXPECT_THAT(std::string(load_sharded(dir, {{9, {0, 1}}}).status().message()), HasSubstr("no state for parameter 9"));
  EXPECT_THAT(std::string(load_sharded(dir, {{0, {0, 41}}}).status().message()), HasSubstr("outside its 40 elements"));
}

TEST(ShardedTest, FailedWriteCommitsNothingAndFailsEveryRank) {
  comm::testing::run_ranks_as_threads(2, [](comm::Group& g) {
    // Each rank writes into a directory that exists only for rank 0.
    const std::string dir = g.rank() == 0 ? std::string("/tmp") : std::string("/nonexistent-dtrain-dir");
    absl::Status s = save_sharded(g, dir, ShardedState{}, "flat");
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(std::string(s.message()), HasSubstr("nothing committed: rank 1:"));
  });
}

}  // namespace
}  // namespace dtrain::checkpoint
