// Ranks as threads of one process, for benchmarks (testonly): Google Benchmark's ->Threads(n)
// runs n copies of a benchmark function at once, and thread i asks for rank i's group here.
// The groups are real Gloo process groups over one in-process store, created on first use and
// kept for the life of the process.
//
//   void BM_AllReduce(benchmark::State& state) {
//     dtrain::comm::Group& g = dtrain::comm::thread_world_rank(state.thread_index(), 2);
//     ...
//   }
//   BENCHMARK(BM_AllReduce)->Threads(2)->UseRealTime();
#ifndef DTRAIN_COMM_TESTING_THREAD_WORLD_H_
#define DTRAIN_COMM_TESTING_THREAD_WORLD_H_

#include "comm/process_group.h"

namespace dtrain::comm {

// REQUIRES: 0 <= rank < world_size; every rank of a world is asked for concurrently the first
// time (rendezvous), and a process uses one world size. TORCH_CHECK on failure.
Group& thread_world_rank(int rank, int world_size);

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_TESTING_THREAD_WORLD_H_
