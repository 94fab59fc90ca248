// DCP saves, world 2 (ranks as threads, Gloo on loopback), each rank holding half of every tensor
// (a ZeRO shard): the synchronous save_dcp, and AsyncDcpSaver's save() (the time the training
// loop is blocked) and save() + wait() (until the checkpoint is committed). Paired with
// bench/peers/dcp_pytorch.py (dcp.save / dcp.async_save on DTensor shards) by bench/dcp_compare.
//
//   dcp_benchmark MIB [REPEATS] [DIR]    prints "sync_save_ms X", "async_blocked_ms Y",
//                                        "async_total_ms Z" (medians over REPEATS, default 5;
//                                        one AsyncDcpSaver per rank for the run, so the median
//                                        is a save after the first, as in a training loop)
// The state: MIB MiB of float32 in tensors of 32 MiB at most (fewer for small totals), written
// under DIR (default $DTRAIN_BENCH_DIR or /tmp/dtrain-bench)/dcp-dtrain-<n>, removed after.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/dcp.h"
#include "checkpoint/dcp_async.h"
#include "comm/testing/thread_world.h"

namespace {

namespace ck = dtrain::checkpoint;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: dcp_benchmark MIB [REPEATS] [DIR]\n");
    return 2;
  }
  const int64_t mib = std::atoll(argv[1]);
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 5;
  const char* env_dir = std::getenv("DTRAIN_BENCH_DIR");
  const std::string root =
      argc > 3 ? argv[3] : (env_dir != nullptr ? env_dir : "/tmp/dtrain-bench");
  const int64_t per_tensor = std::min<int64_t>(mib, 32) << 18;  // float32 elements
  const int64_t tensors = (mib << 18) / per_tensor;
  std::vector<double> sync_ms, blocked_ms, total_ms;
  int run = 0;
  for (int rep = 0; rep < repeats; ++rep) {
    // The second save of a pair runs slower (the first one's files being removed and written
    // back): each kind goes first in every other repeat.
    for (const bool async : {rep % 2 == 1, rep % 2 == 0}) {
      const std::string dir = absl::StrCat(root, "/dcp-dtrain-", run++);
      if (std::system(absl::StrCat("rm -rf '", dir, "' && mkdir -p '", dir, "'").c_str()) != 0)
        return 1;
      std::vector<std::thread> ranks;
      for (int r = 0; r < 2; ++r) {
        ranks.emplace_back([&, r] {
          dtrain::comm::Group& g = dtrain::comm::thread_world_rank(r, 2);
          std::vector<ck::DcpWriteItem> mine;
          for (int64_t i = 0; i < tensors; ++i) {
            mine.push_back(ck::DcpWriteItem::chunk(absl::StrCat("optim.state.p", i, ".exp_avg"),
                                                   {per_tensor}, {r * per_tensor / 2},
                                                   at::randn({per_tensor / 2})));
          }
          std::vector<at::Tensor> barrier = {at::zeros({1})};
          g->allreduce(barrier)->wait();
          const Clock::time_point t0 = Clock::now();
          if (!async) {
            const absl::Status s = ck::save_dcp(g, dir, mine);
            if (!s.ok()) std::fprintf(stderr, "%s\n", s.ToString().c_str());
            if (r == 0) sync_ms.push_back(ms_since(t0));
            return;
          }
          // One saver per rank for the whole run, as a training loop keeps one (its staging
          // buffers are reused from the second save on); nothing else runs on g meanwhile.
          static std::unique_ptr<ck::AsyncDcpSaver> savers[2];
          if (savers[r] == nullptr) savers[r] = std::make_unique<ck::AsyncDcpSaver>(g);
          absl::Status s = savers[r]->save(dir, mine);
          const double blocked = ms_since(t0);
          if (s.ok()) s = savers[r]->wait();
          if (!s.ok()) std::fprintf(stderr, "%s\n", s.ToString().c_str());
          if (r == 0) {
            blocked_ms.push_back(blocked);
            total_ms.push_back(ms_since(t0));
          }
        });
      }
      for (std::thread& t : ranks) t.join();
      if (std::system(absl::StrCat("rm -rf '", dir, "'").c_str()) != 0) return 1;
    }
  }
  std::printf("sync_save_ms %.1f\nasync_blocked_ms %.1f\nasync_total_ms %.1f\n", median(sync_ms),
              median(blocked_ms), median(total_ms));
  return 0;
}
