// Fuzz target: the sharded checkpoint's metadata (checkpoint/sharded.h). A one-rank save_sharded
// writes a real checkpoint once; each input is then a pickle written into its metadata.pt (in a
// valid archive, so the CRCs pass and the metadata parser is what the input reaches), and
// read_sharded_info and load_sharded run over the directory. Both must return a Status (never
// throw, never read outside a shard); a loaded piece's tensors must be readable in full.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "absl/strings/str_cat.h"
#include "checkpoint/fuzz_support.h"
#include "checkpoint/sharded.h"
#include "comm/process_group.h"
#include "fuzz/fuzz_target.h"

namespace {

namespace ck = dtrain::checkpoint;

struct Saved {
  std::string dir;
  std::string metadata;  // the file save_sharded wrote
};

// A checkpoint of two parameters, one whole and one element range, as a flat ZeRO shard holds.
const Saved& saved() {
  static const Saved kSaved = [] {
    Saved s;
    const char* tmp = std::getenv("TEST_TMPDIR");
    s.dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/dtrain_fuzz_sharded_", ::getpid());
    [[maybe_unused]] int rc = std::system(absl::StrCat("mkdir -p '", s.dir, "'").c_str());
    dtrain::comm::InitOptions o;
    o.store = c10::make_intrusive<c10d::HashStore>();
    o.rank = 0;
    o.world_size = 1;
    absl::StatusOr<dtrain::comm::Group> g = dtrain::comm::init_process_group(o);
    DTRAIN_FUZZ_CHECK(g.ok(), g.status().ToString());
    ck::ShardedState mine;
    ck::ShardedState::Param whole;
    whole.shape = {3, 4};
    whole.range = {0, 12};
    whole.entries.insert("step", at::scalar_tensor(5.0));
    whole.entries.insert("exp_avg", at::arange(12, at::kFloat).reshape({3, 4}));
    mine.params[0] = whole;
    ck::ShardedState::Param part;
    part.shape = {10};
    part.range = {2, 7};
    part.entries.insert("step", at::scalar_tensor(5.0));
    part.entries.insert("momentum_buffer", at::arange(5, at::kDouble));
    mine.params[1] = part;
    mine.extra = c10::IValue(int64_t{100});
    const absl::Status st = ck::save_sharded(*g, s.dir, mine, "flat");
    DTRAIN_FUZZ_CHECK(st.ok(), st.ToString());
    std::ifstream in(s.dir + "/metadata.pt", std::ios::binary);
    s.metadata.assign(std::istreambuf_iterator<char>(in), {});
    return s;
  }();
  return kSaved;
}

}  // namespace

namespace dtrain::fuzz {

std::vector<std::string> seeds() { return {checkpoint::testing::pickle_of(saved().metadata)}; }

}  // namespace dtrain::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Saved& s = saved();
  const std::string pickle(reinterpret_cast<const char*>(data), size);
  std::ofstream(s.dir + "/metadata.pt", std::ios::binary | std::ios::trunc)
      << ck::testing::with_pickle(s.metadata, pickle);
  try {
    absl::StatusOr<ck::ShardedInfo> info = ck::read_sharded_info(s.dir);
    if (info.ok()) {
      ck::testing::touch_all(info->param_groups);
      ck::testing::touch_all(info->extra);
    }
    for (const std::map<int64_t, dtrain::partition::Range>& wanted :
         {std::map<int64_t, dtrain::partition::Range>{{0, {0, 12}}, {1, {2, 7}}},
          {{0, {5, 9}}, {1, {0, 10}}},
          {{1, {3, 4}}}}) {
      absl::StatusOr<ck::ShardedState> got = ck::load_sharded(s.dir, wanted);
      if (!got.ok()) continue;
      for (const auto& [index, param] : got->params) {
        for (const auto& kv : param.entries) ck::testing::touch_all(kv.value());
      }
    }
  } catch (const std::exception& e) {
    DTRAIN_FUZZ_CHECK(
        false, absl::StrCat("a sharded-checkpoint reader threw instead of returning a Status: ",
                            e.what()));
  }
  return 0;
}
