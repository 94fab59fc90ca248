#include "checkpoint/sharded.h"

#include <dirent.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <iterator>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint/state_file.h"
#include "checkpoint/stored_zip.h"
#include "checkpoint/test_zip.h"
#include "checkpoint/torch_file_writer.h"
#include "comm/testing/test_harness.h"
#include "partition/flat_partition.h"
#include "partition/sorted_greedy.h"

namespace dtrain::checkpoint {
namespace {

using ::testing::AllOf;
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

ShardedState shard_of(const std::vector<Dict>& global,
                      const std::map<int64_t, partition::Range>& pieces) {
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
    absl::Status s =
        save_sharded(g, dir, shard_of(global, owned(strategy, world, g.rank())), strategy);
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
          EXPECT_TRUE(a.toTensor().equal(kv.value().toTensor()))
              << "rank " << rank << " param " << i << " " << kv.key().toStringRef();
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
        SCOPED_TRACE(saved + " " + std::to_string(from) + " -> " + loaded + " " +
                     std::to_string(to));
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
  while (dirent* e = ::readdir(d))
    if (std::string(e->d_name).rfind("shard-", 0) == 0) shard = e->d_name;
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
  EXPECT_THAT(std::string(incomplete.status().message()),
              HasSubstr("incomplete checkpoint: " + dir));
  EXPECT_EQ(read_sharded_info(temp_dir()).status().code(), absl::StatusCode::kNotFound);
}

std::string shard_file(const std::string& dir, int rank) {
  std::string name;
  DIR* d = ::opendir(dir.c_str());
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind("shard-", 0) == 0 && n.size() > 5 &&
        n.substr(n.size() - 5) == "-" + std::to_string(rank) + ".pt") {
      name = n;
    }
  }
  ::closedir(d);
  return name;
}

void copy_file(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  std::ofstream out(to, std::ios::binary | std::ios::trunc);
  out << in.rdbuf();
}

// A shard copied over another rank's -- rank 1's over rank 0's: the same parameters, other
// elements, as many of them under the flat partition -- is a whole, checksum-valid file; the load
// refuses it, naming the shard, instead of handing back another rank's state.
TEST(ShardedTest, AShardInAnothersPlaceIsRefused) {
  for (const std::string strategy : {"flat", "sorted_greedy"}) {
    SCOPED_TRACE(strategy);
    const std::string dir = temp_dir();
    save_at(dir, strategy, 2);
    const std::string rank0 = shard_file(dir, 0), rank1 = shard_file(dir, 1);
    ASSERT_FALSE(rank0.empty());
    ASSERT_FALSE(rank1.empty());
    copy_file(dir + "/" + rank1, dir + "/" + rank0);
    auto swapped = load_sharded(dir, owned(strategy, 1, 0));
    EXPECT_EQ(swapped.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(swapped.status().message()),
                AllOf(HasSubstr("shard " + rank0), HasSubstr("another rank or save")));
  }
  // A shard of an earlier save with the same layout and state is the same bytes (shards record
  // no save id, so that two saves of one state compare equal: train_fault_test) and loads.
  const std::string earlier = temp_dir(), later = temp_dir();
  save_at(earlier, "flat", 2);
  save_at(later, "flat", 2);
  auto bytes = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(bytes(earlier + "/" + shard_file(earlier, 0)),
            bytes(later + "/" + shard_file(later, 0)));
  copy_file(earlier + "/" + shard_file(earlier, 0), later + "/" + shard_file(later, 0));
  EXPECT_TRUE(load_sharded(later, owned("flat", 2, 0)).ok());
  // The untouched rank's pieces still load.
  EXPECT_TRUE(load_sharded(later, owned("flat", 2, 1)).ok());
}

// Metadata that passes its checksum but lies: every variant is a DataLoss naming the problem,
// never an exception, a crash or uninitialised memory handed back.
TEST(ShardedTest, HostileMetadataIsAStatusNeverAThrow) {
  using Mutation = std::function<void(Dict&)>;
  auto shard = [](Dict& m, size_t i) { return m.at("shards").toList().get(i).toGenericDict(); };
  auto first_range_key = [&](Dict& m) {
    return (*shard(m, 0).at("ranges").toGenericDict().begin()).key();
  };
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
      {"negative shape",
       [](Dict& m) {
         c10::impl::GenericList l(c10::AnyType::get());
         l.push_back(int64_t{-2});
         l.push_back(int64_t{-3});
         m.at("shapes").toGenericDict().insert_or_assign(int64_t{0}, l);
       }},
      {"overflowing shape",
       [](Dict& m) {
         c10::impl::GenericList l(c10::AnyType::get());
         l.push_back(int64_t{1} << 40);
         l.push_back(int64_t{1} << 40);
         m.at("shapes").toGenericDict().insert_or_assign(int64_t{0}, l);
       }},
      {"two shards claim the same elements",
       [&](Dict& m) {
         shard(m, 1).insert_or_assign("ranges", shard(m, 0).at("ranges").toGenericDict().copy());
       }},
      {"a shard file outside the directory",
       [&](Dict& m) { shard(m, 0).insert_or_assign("file", std::string("../x.pt")); }},
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
  EXPECT_THAT(std::string(load_sharded(dir, {{9, {0, 1}}}).status().message()),
              HasSubstr("no state for parameter 9"));
  EXPECT_THAT(std::string(load_sharded(dir, {{0, {0, 41}}}).status().message()),
              HasSubstr("outside its 40 elements"));
}

// load_sharded's map_location, on the meta device (no GPU needed): every tensor moves, the rest
// stays as it is.
TEST(ShardedTest, MapLocationMovesWhatIsLoaded) {
  const std::string dir = temp_dir();
  save_at(dir, "flat", 2);
  LoadOptions meta;
  meta.map_location = c10::Device(c10::kMeta);
  absl::StatusOr<ShardedState> on_cpu = load_sharded(dir, owned("sorted_greedy", 1, 0));
  absl::StatusOr<ShardedState> moved = load_sharded(dir, owned("sorted_greedy", 1, 0), meta);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  ASSERT_TRUE(moved.ok()) << moved.status();
  ASSERT_EQ(moved->params.size(), kShapes.size());
  for (const auto& [i, p] : on_cpu->params) {
    for (const auto& kv : p.entries) {
      const c10::IValue& m = moved->params.at(i).entries.at(kv.key());
      if (!kv.value().isTensor()) {
        EXPECT_EQ(m, kv.value());
        continue;
      }
      const at::Tensor& want = kv.value().toTensor();
      EXPECT_TRUE(want.device().is_cpu());
      EXPECT_TRUE(m.toTensor().is_meta()) << i << " " << kv.key().toStringRef();
      EXPECT_EQ(m.toTensor().sizes().vec(), want.sizes().vec());
      EXPECT_EQ(m.toTensor().scalar_type(), want.scalar_type());
    }
  }
}

// load_state's map_location (checkpoint/state_file.h; here for want of room in state_file_test),
// on the meta device: each storage moves once, so views keep sharing theirs, a tensor reached
// twice stays one tensor, requires_grad is kept, and tensors in tuples, lists and keys move too.
TEST(LoadMapLocationTest, MovesStorageByStorage) {
  const at::Tensor base = at::arange(24, at::kFloat);
  Dict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("base", base);
  d.insert("row", base.narrow(0, 4, 4));
  d.insert("transposed", base.view({4, 6}).t());
  d.insert("again", base);
  d.insert("grad", at::ones({2}).requires_grad_());
  d.insert("tuple", c10::ivalue::Tuple::create(
                        {c10::IValue(base.narrow(0, 1, 2)), c10::IValue(int64_t{7})}));
  d.insert("list", c10::List<at::Tensor>({at::zeros({3}, at::kLong)}));
  Dict keyed(c10::AnyType::get(), c10::AnyType::get());
  keyed.insert(at::ones({1}), std::string("tensor key"));
  d.insert("keyed", keyed);
  const std::string path = temp_dir() + "/moved.pt";
  ASSERT_TRUE(save_state(path, d).ok());
  LoadOptions meta;
  meta.map_location = c10::Device(c10::kMeta);
  absl::StatusOr<c10::IValue> back = load_state(path, meta);
  ASSERT_TRUE(back.ok()) << back.status();
  const Dict b = back->toGenericDict();
  auto tensor = [&](const char* key) { return b.at(key).toTensor(); };
  for (const char* key : {"base", "row", "transposed", "again", "grad"}) {
    const at::Tensor want = d.at(key).toTensor();
    EXPECT_TRUE(tensor(key).is_meta()) << key;
    EXPECT_EQ(tensor(key).sizes().vec(), want.sizes().vec()) << key;
    EXPECT_EQ(tensor(key).strides().vec(), want.strides().vec()) << key;
    EXPECT_EQ(tensor(key).storage_offset(), want.storage_offset()) << key;
  }
  const void* shared = tensor("base").storage().unsafeGetStorageImpl();
  EXPECT_EQ(tensor("row").storage().unsafeGetStorageImpl(), shared);
  EXPECT_EQ(tensor("transposed").storage().unsafeGetStorageImpl(), shared);
  EXPECT_TRUE(tensor("again").is_same(tensor("base")));
  EXPECT_TRUE(tensor("grad").requires_grad());
  EXPECT_FALSE(tensor("base").requires_grad());
  const at::Tensor in_tuple = b.at("tuple").toTupleRef().elements()[0].toTensor();
  EXPECT_TRUE(in_tuple.is_meta());
  EXPECT_EQ(in_tuple.storage().unsafeGetStorageImpl(), shared);
  EXPECT_EQ(b.at("tuple").toTupleRef().elements()[1].toInt(), 7);
  EXPECT_TRUE(b.at("list").toTensorVector().at(0).is_meta());
  const Dict keyed_back = b.at("keyed").toGenericDict();
  ASSERT_EQ(keyed_back.size(), 1u);
  EXPECT_TRUE((*keyed_back.begin()).key().toTensor().is_meta());
  EXPECT_EQ((*keyed_back.begin()).value().toStringRef(), "tensor key");
  // The default: views into the file's bytes on the CPU, as before.
  absl::StatusOr<c10::IValue> cpu = load_state(path);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_TRUE(cpu->toGenericDict().at("row").toTensor().device().is_cpu());
  EXPECT_TRUE(cpu->toGenericDict().at("row").toTensor().equal(base.narrow(0, 4, 4)));
}

// torch.save records a GPU tensor's storage as on 'cuda:0': such a file loads without a GPU, onto
// the CPU by default or wherever map_location says; a device this process lacks is refused.
TEST(LoadMapLocationTest, FilesSavedFromAGpuLoadWithoutOne) {
  const at::Tensor base = at::arange(6, at::kFloat);
  Dict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("w", base);
  d.insert("view", base.narrow(0, 2, 3));
  absl::StatusOr<std::string> bytes = write_torch_file(d);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<StoredZip> zip = read_stored_zip(*bytes, "written");
  ASSERT_TRUE(zip.ok()) << zip.status();
  // BINUNICODE 'cpu' -> 'cuda:0', written once (memoized after).
  const std::string cpu(
      "X\x03\x00\x00\x00"
      "cpu",
      8),
      cuda(
          "X\x06\x00\x00\x00"
          "cuda:0",
          11);
  std::vector<std::pair<std::string, std::string>> entries;
  for (const ZipEntry& e : zip->entries) {
    std::string data(e.data);
    if (e.name == "archive/data.pkl") {
      const size_t where = data.find(cpu);
      ASSERT_NE(where, std::string::npos);
      data.replace(where, cpu.size(), cuda);
      ASSERT_EQ(data.find(cpu), std::string::npos);
    }
    entries.emplace_back(e.name, std::move(data));
  }
  const std::string path = temp_dir() + "/from_gpu.pt";
  std::ofstream(path, std::ios::binary) << dtrain::checkpoint::testing::make_zip(entries);
  absl::StatusOr<c10::IValue> back = load_state(path);
  ASSERT_TRUE(back.ok()) << back.status();
  const at::Tensor w = back->toGenericDict().at("w").toTensor(),
                   view = back->toGenericDict().at("view").toTensor();
  EXPECT_TRUE(w.device().is_cpu());
  EXPECT_TRUE(w.equal(base));
  EXPECT_TRUE(view.equal(base.narrow(0, 2, 3)));
  EXPECT_EQ(view.storage().unsafeGetStorageImpl(), w.storage().unsafeGetStorageImpl());
  LoadOptions meta;
  meta.map_location = c10::Device(c10::kMeta);
  absl::StatusOr<c10::IValue> moved = load_state(path, meta);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_TRUE(moved->toGenericDict().at("w").toTensor().is_meta());
  LoadOptions absent;
  absent.map_location = c10::Device(c10::kCUDA, 99);
  absl::StatusOr<c10::IValue> refused = load_state(path, absent);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("(map_location)"));
}

TEST(ShardedTest, FailedWriteCommitsNothingAndFailsEveryRank) {
  comm::testing::run_ranks_as_threads(2, [](comm::Group& g) {
    // Each rank writes into a directory that exists only for rank 0.
    const std::string dir =
        g.rank() == 0 ? std::string("/tmp") : std::string("/nonexistent-dtrain-dir");
    absl::Status s = save_sharded(g, dir, ShardedState{}, "flat");
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(std::string(s.message()), HasSubstr("nothing committed: rank 1:"));
  });
}

}  // namespace
}  // namespace dtrain::checkpoint
