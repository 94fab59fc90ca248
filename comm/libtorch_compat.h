// comm/'s LibTorch version layer: the one file in comm/ (and in its users) that tests LibTorch's
// version. dtrain builds against LibTorch 1.13 and 2.x (README, "Supported LibTorch").
//
// Since LibTorch 2.0, c10d::ProcessGroupGloo / ProcessGroupNCCL derive from c10d::Backend, and
// c10d::ProcessGroup is a front end that routes each collective through the dispatcher to a
// Backend per device type. In 1.13 they derive from c10d::ProcessGroup itself. Both bases offer
// the same virtual collectives (allreduce, broadcast, allgather, barrier, getRank, getSize, ...),
// so dtrain holds the backend object directly as `comm::C10dGroup`: no dispatcher hop per call,
// and one spelling for every caller.
//
//   dtrain::comm::C10dGroup& pg = *group.pg();
//   pg.allreduce(tensors)->wait();
#ifndef DTRAIN_COMM_LIBTORCH_COMPAT_H_
#define DTRAIN_COMM_LIBTORCH_COMPAT_H_

#include <torch/version.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

namespace dtrain::comm {

#if TORCH_VERSION_MAJOR >= 2
using C10dGroup = c10d::Backend;
// LibTorch 2.x Gloo has reduce_scatter_tensor (_reduce_scatter_base; SUM), 1.13's has none: there
// both it and the list form throw "does not support" (the list form throws in 2.6 too). 2.x Gloo
// implements it as an all-reduce of a copy of the input followed by a local copy of this rank's
// chunk (twice the bytes per rank of a ring reduce-scatter; its Work's isCompleted() stays false
// even after wait()), so comm/reduce_scatter.h uses an all-to-all on Gloo on both versions.
inline constexpr bool kGlooHasReduceScatter = true;
// LibTorch 2.x Gloo reduces bfloat16 tensors; 1.13's fails with "Invalid scalar type".
inline constexpr bool kGlooReducesBFloat16 = true;
#else
using C10dGroup = c10d::ProcessGroup;
inline constexpr bool kGlooHasReduceScatter = false;
inline constexpr bool kGlooReducesBFloat16 = false;
#endif

// TCPStore options with the classic (non-libuv) server. LibTorch 2.4+ defaults to the libuv
// server, which distribution builds (Debian's among them) leave out ("use_libuv was requested but
// PyTorch was build without libuv support"); the classic one exists in every version.
inline c10d::TCPStoreOptions tcp_store_options() {
  c10d::TCPStoreOptions o;
#if TORCH_VERSION_MAJOR >= 2
  o.useLibUV = false;
#endif
  return o;
}

// Whether TCPStoreOptions takes a listening socket bound by the caller (masterListenFd, LibTorch
// 2.4 and later): then the store listens only on MASTER_ADDR's interface. Older LibTorch's store
// listens on every interface (README, "Security").
inline constexpr bool kTcpStoreTakesListenFd =
    TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4);
inline void set_store_listen_fd(c10d::TCPStoreOptions& o, int fd) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  o.masterListenFd = fd;
#else
  (void)o;
  (void)fd;
#endif
}

// "major.minor.patch" of the LibTorch this dtrain was compiled against.
inline constexpr const char* kLibTorchVersion = TORCH_VERSION;

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_LIBTORCH_COMPAT_H_
