// A process group that counts the bytes its collectives send (testonly): wrap a Group, run code
// through the wrapper, and compare the bytes with a communication-volume formula, e.g. ZeRO-1
// (all-reduce of gradients) against ZeRO-2 (reduce-scatter of gradients), both followed by an
// all-gather of parameters.
//
//   auto counter = std::make_shared<dtrain::comm::ByteCounter>();
//   dtrain::comm::Group counted = dtrain::comm::counting_group(group, counter);
//   std::vector<at::Tensor> t = {at::ones({1000})};       // 4000 bytes
//   counted->allreduce(t)->wait();
//   // counter->snapshot()["allreduce"] == {calls 1, bytes 2*(n-1)*4000/n}
//
// What is counted: the bytes this rank sends in a bandwidth-optimal algorithm, the accounting of
// NCCL's "bus bandwidth", not what the backend actually puts on the wire (Gloo may use other
// algorithms). With S the total bytes of the call's tensors (every tensor of a list) and n the
// group size, per call, in integer arithmetic rounded down once per call:
//   key "allreduce"       allreduce, allreduce_coalesced      2*(n-1)*S/n   (ring all-reduce)
//   key "broadcast"       broadcast                           (n-1)*S/n     (pipelined broadcast,
//                                                                            averaged over ranks)
//   key "reduce"          reduce                              (n-1)*S/n     (its dual, likewise)
//   key "allgather"       allgather, _allgather_base,         (n-1)*I       (I: bytes of this
//                         allgather_coalesced                                rank's inputs)
//   key "reduce_scatter"  reduce_scatter, _reduce_scatter_base (n-1)*S_in/n (S_in: the inputs)
//   key "alltoall"        alltoall, alltoall_base             (n-1)*S_in/n  (equal splits; with
//                                                                            uneven ones an average)
//   key "gather"          gather                              I on non-roots, 0 on the root
//   key "scatter"         scatter                             (n-1)*O on the root (O: bytes of
//                                                                        its output), 0 elsewhere
//   key "send"            send                                S
//   key "recv"            recv, recvAnysource                 0 (calls only)
//   key "barrier"         barrier, monitoredBarrier           0 (calls only)
// Every call is forwarded to the wrapped group's own c10d group and returns its Work; counts are
// taken when the call is issued (a call that throws is not counted). A group of one counts 0 bytes.
// dtrain::comm::reduce_scatter_tensor shows up as "reduce_scatter" where the backend reduces
// (LibTorch 2.x) and as "alltoall" where it is emulated (1.13 Gloo): same bytes either way.
// Not forwarded: LibTorch 2.x-only entry points of c10d::Backend (startCoalescing/endCoalescing,
// allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced, allreduce_sparse) throw the
// base class's "does not support"; dtrain's portable code does not call them.
#ifndef DTRAIN_COMM_TESTING_COUNTING_GROUP_H_
#define DTRAIN_COMM_TESTING_COUNTING_GROUP_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "comm/process_group.h"

namespace dtrain::comm {

struct CollectiveCounts {
  int64_t calls = 0;
  int64_t bytes = 0;
};

// Thread-safe counters shared by the wrapper and the caller (one per rank, or one for several
// ranks run as threads: then the sums are over those ranks).
class ByteCounter {
 public:
  // One call of `collective` that sent `bytes`. REQUIRES bytes >= 0.
  void add(const std::string& collective, int64_t bytes);
  // Per collective name, those with at least one call.
  std::map<std::string, CollectiveCounts> snapshot() const;
  // Sum of bytes over all collectives.
  int64_t total_bytes() const;
  void reset();

 private:
  mutable std::mutex mu_;
  std::map<std::string, CollectiveCounts> counts_;
};

// A Group with the same ranks, stores, timeout and backend as `group` whose pg() forwards every
// collective to group's own and adds to `counter` (table above). `group` and its other users are
// unaffected: they share the c10d group, so calls through either interleave in issue order as on
// one group, and only calls made through the returned Group are counted. Subgroups made from the
// returned Group with new_group are plain, uncounted groups (wrap subgroups of `group` instead);
// they are named apart from `group`'s own.
// REQUIRES: group.is_member(); counter != nullptr.
Group counting_group(const Group& group, std::shared_ptr<ByteCounter> counter);

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_TESTING_COUNTING_GROUP_H_
