#include "checkpoint/sharded.h"

#include <dirent.h>
#include <unistd.h>

#include <fstream>
#include <functional>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint/state_file.h"
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
std::map<int64_t, partition::Range> owned(const std::string& strategy, int world, int rank) {
  std::map<int64_t, partition::Range> out;
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

ShardedState shard_of(const std::vector<Dict>& global, const std::map<int64_t, partition::Range>& pieces) {
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

// Metadata that passes its checksum but lies: every variant is a DataLoss naming the problem,
// never an exception, a crash or uninitialised memory handed back.
TEST(ShardedTest, HostileMetadataIsAStatusNeverAThrow) {
  using Mutation = std::function<void(Dict&)>;
  auto shard = [](Dict& m, size_t i) { return m.at("shards").toList().get(i).toGenericDict(); };
  auto first_range_key = [&](Dict& m) { return (*shard(m, 0).at("ranges").toGenericDict().begin()).key(); };
  auto set_range = [&](std::vector<c10::IValue> r) {
    return Mutation([&, r](Dict& m) {
      c10::impl::GenericList l(c10::AnyType::get());
      for (const auto& v : r) l.push_back(v);
      shard(m, 0).at("ranges").toGenericDict().insert_or_assign(first_range_key(m), l);
    });
  };
  const std::vector<std::pair<std::string, Mutation>> cases = {
      {"no world_size", [](Dict& m) { (void)m.erase("world_size"); }},
      {"world_size a string", [](Dict& m) { m.insert_or_assign("world_size", std::string("2")); }},
      {"empty range", set_range({})},
      {"one-element range", set_range({int64_t{3}})},
      {"negative range", set_range({int64_t{-3}, int64_t{5}})},
      {"range past the parameter", set_range({int64_t{0}, int64_t{1} << 40})},
      {"negative shape", [](Dict& m) {
         c10::impl::GenericList l(c10::AnyType::get());
         l.push_back(int64_t{-2});
         l.push_back(int64_t{-3});
         m.at("shapes").toGenericDict().insert_or_assign(int64_t{0}, l);
       }},
      {"overflowing shape", [](Dict& m) {
         c10::impl::GenericList l(c10::AnyType::get());
         l.push_back(int64_t{1} << 40);
         l.push_back(int64_t{1} << 40);
         m.at("shapes").toGenericDict().insert_or_assign(int64_t{0}, l);
       }},
      {"two shards claim the same elements", [&](Dict& m) {
         shard(m, 1).insert_or_assign("ranges", shard(m, 0).at("ranges").toGenericDict().copy());
       }},
      {"a shard file outside the directory", [&](Dict& m) { shard(m, 0).insert_or_assign("file", std::string("../x.pt")); }},
      {"shards not a list", [](Dict& m) { m.insert_or_assign("shards", int64_t{7}); }},
  };
  for (const auto& [name, mutate] : cases) {
    const std::string dir = temp_dir();
    save_at(dir, "flat", 2);
    absl::StatusOr<c10::IValue> meta = load_state(dir + "/metadata.pt");
    ASSERT_TRUE(meta.ok());
    Dict m = meta->toGenericDict();
    mutate(m);
    ASSERT_TRUE(save_state(dir + "/metadata.pt", m).ok());
    absl::StatusOr<ShardedState> got = absl::UnknownError("not run");
    EXPECT_NO_THROW(got = load_sharded(dir, owned("flat", 1, 0))) << name;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << name << ": " << got.status();
  }
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
