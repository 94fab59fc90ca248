// What a cluster benchmark's rank reads about its own host (bench/cluster/run): the bytes its
// network namespace has sent on the shaped link, and the CPU time its process has used.
//
//   const int64_t tx0 = dtrain::bench::tx_bytes();
//   step();
//   const int64_t sent = dtrain::bench::tx_bytes() - tx0;   // this host's bytes on the link
//
// Thread safety: both may be called from any thread.
#ifndef DTRAIN_BENCH_CLUSTER_LINK_STATS_H_
#define DTRAIN_BENCH_CLUSTER_LINK_STATS_H_

#include <cstdint>

namespace dtrain::bench {

// Bytes this network namespace's eth0 has sent (the cluster's shaped link; /proc/net/dev), or 0
// without one.
int64_t tx_bytes();

// CPU time this process has used (every thread, user + system), in ms.
double cpu_ms();

}  // namespace dtrain::bench

#endif  // DTRAIN_BENCH_CLUSTER_LINK_STATS_H_
