// Multi-rank test harness (testonly): runs a function on W ranks over real Gloo process groups,
// either as threads of this process over an in-process store (fast: the default), or as real
// processes rendezvousing over TCP on 127.0.0.1 (for launcher, env:// and fault tests).
//
//   TEST(AllReduceTest, SumsAcrossRanks) {
//     dtrain::comm::testing::run_ranks_as_threads(3, [](dtrain::comm::Group& g) {
//       std::vector<at::Tensor> t = {at::full({2}, g.rank() + 1.0)};
//       g->allreduce(t)->wait();
//       EXPECT_TRUE(t[0].equal(at::full({2}, 6.0)));
//     });
//   }
//
// A rank that throws fails the test with "rank R: <message>". A collective that hangs throws
// after `timeout` (the group's collective timeout); ranks still running after timeout + grace fail
// the test and end the test process instead of hanging the suite.
#ifndef DTRAIN_COMM_TESTING_TEST_HARNESS_H_
#define DTRAIN_COMM_TESTING_TEST_HARNESS_H_

#include <chrono>
#include <functional>
#include <string>
#include <utility>

#include "comm/process_group.h"

namespace dtrain::comm::testing {

struct HarnessOptions {
  // Collective timeout of the groups the harness creates.
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  // Extra wall time after `timeout` before a rank counts as hung.
  std::chrono::milliseconds grace = std::chrono::seconds(15);
  std::string backend = "gloo";
};

// HarnessOptions with `backend` ("nccl" for the GPU tests, "cpu:gloo,cuda:nccl", ...), the rest
// at their defaults.
inline HarnessOptions with_backend(std::string backend) {
  HarnessOptions o;
  o.backend = std::move(backend);
  return o;
}

using RankFn = std::function<void(Group& world)>;

// Runs fn(world) on world_size threads, each with its own Gloo process group over one HashStore.
void run_ranks_as_threads(int world_size, const RankFn& fn, const HarnessOptions& options = {});

// Runs fn(world) in world_size child processes that re-execute this test binary restricted to the
// current test; each child rendezvous through env:// (MASTER_ADDR=127.0.0.1, a free MASTER_PORT,
// RANK, WORLD_SIZE, LOCAL_RANK). Code before the call runs in every child too, so call it once per
// test. The parent only waits and reports: a child that fails, crashes or hangs fails the test,
// with that rank's output. Children never outlive the test process, however it ends
// (launcher/process_set.h).
void run_ranks_as_processes(int world_size, const RankFn& fn, const HarnessOptions& options = {});

// True inside a child started by run_ranks_as_processes.
bool in_rank_process();

// A TCP port on 127.0.0.1 that was free a moment ago (comm::free_port, from launcher/process_set.h).
int free_port();

}  // namespace dtrain::comm::testing

#endif  // DTRAIN_COMM_TESTING_TEST_HARNESS_H_
