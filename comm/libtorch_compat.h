// comm/'s LibTorch version layer: the one file in comm/ (and in its users) that tests LibTorch's
// version. dtrain builds against LibTorch 2.x (docs/libtorch.md; 1.13 was retired
// after commit d5a9c1f).
//
// c10d::ProcessGroupGloo / ProcessGroupNCCL derive from c10d::Backend, and c10d::ProcessGroup is
// a front end that routes each collective through the dispatcher to a Backend per device type.
// dtrain holds the backend object directly as `comm::C10dGroup`: no dispatcher hop per call, and
// one spelling for every caller.
//
//   dtrain::comm::C10dGroup& pg = *group.pg();
//   pg.allreduce(tensors)->wait();
#ifndef DTRAIN_COMM_LIBTORCH_COMPAT_H_
#define DTRAIN_COMM_LIBTORCH_COMPAT_H_

#include <torch/version.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace dtrain::comm {

using C10dGroup = c10d::Backend;
// Gloo's reduce_scatter_tensor (_reduce_scatter_base; SUM) is an all-reduce of a copy of the input
// followed by a local copy of this rank's chunk (twice the bytes per rank of a ring reduce-scatter;
// its Work's isCompleted() stays false even after wait()), and the list form throws "does not
// support", so comm/reduce_scatter.h uses an all-to-all on Gloo.

// Shuts a backend down (NCCL: its communicators destroyed; the others: nothing to do) where
// c10d::Backend has shutdown() (2.11 and 2.14 do; 2.6 has none, and no 2.6 build here has NCCL).
template <typename Backend>
inline constexpr bool kHasShutdown = requires(Backend& b) {
  b.shutdown();
};
inline constexpr bool kBackendHasShutdown = kHasShutdown<C10dGroup>;
static_assert(kBackendHasShutdown || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 11),
              "c10d::Backend::shutdown() is expected from LibTorch 2.11 on: without it NCCL groups "
              "are never shut down (comm/libtorch_compat.h)");
template <typename Backend>
void shutdown_backend(Backend& backend) {
  if constexpr (kHasShutdown<Backend>) backend.shutdown();
}

// TCPStore options with the classic (non-libuv) server. LibTorch 2.4+ defaults to the libuv
// server, which distribution builds (Debian's among them) leave out ("use_libuv was requested but
// PyTorch was build without libuv support"); the classic one exists in every version.
inline c10d::TCPStoreOptions tcp_store_options() {
  c10d::TCPStoreOptions o;
  o.useLibUV = false;
  return o;
}

// Whether TCPStoreOptions takes a listening socket bound by the caller (masterListenFd, LibTorch
// 2.4 and later): then the store listens only on MASTER_ADDR's interface. Older LibTorch's store
// listens on every interface (README, "Security").
inline constexpr bool kTcpStoreTakesListenFd = TORCH_VERSION_MAJOR > 2 ||
                                               (TORCH_VERSION_MAJOR == 2 &&
                                                TORCH_VERSION_MINOR >= 4);
inline void set_store_listen_fd(c10d::TCPStoreOptions& o, int fd) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  o.masterListenFd = fd;
#else
  (void)o;
  (void)fd;
#endif
}

// c10d's flight recorder (its record of recent collectives, on by default: TORCH_FR_BUFFER_SIZE
// 2000) adds a process group to a map the whole process shares at the group's first collective,
// and before 2.14 does so outside its lock: two threads issuing collectives at once, one of them
// on a group not used before, can crash the process (seen with PyTorch's 2.11 wheel: SIGSEGV in
// FlightRecorder::recordWithResetEnabled under ProcessGroupGloo::enqueue, ranks as threads; 2.6's
// Gloo records nothing, 2.14 takes the lock first). The versions in between are taken as affected.
// Ranks-as-threads tests turn the recorder off there (comm/testing/test_harness.cc); see
// docs/libtorch.md for programs.
inline constexpr bool kFlightRecorderRacesOnNewGroups =
    TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7 && TORCH_VERSION_MINOR < 14;

// "major.minor.patch" of the LibTorch this dtrain was compiled against.
inline constexpr const char* kLibTorchVersion = TORCH_VERSION;

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_LIBTORCH_COMPAT_H_
