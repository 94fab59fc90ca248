// The thread on which communication hooks run their chains (PowerSGD's three all-reduces and the
// work between them, the ZeRO overlap hook's step and broadcasts), so that backward does not wait
// for them: PyTorch chains these with Future::then. One worker per process group, shared by every
// hook on it, runs the jobs one at a time in the order they were submitted -- so each rank issues
// its collectives in the same order however the network times them, which chained callbacks on
// Gloo's threads do not promise. Internal to ddp_hooks/.
//
//   std::shared_ptr<OrderedWorker> worker = OrderedWorker::for_group(group);
//   return worker->submit([=]() mutable { return run_chain(bucket); }, bucket.getBuffer());
//
// A job submitted from a worker's own thread (a hook wrapping another) runs inline, at once.
#ifndef DTRAIN_DDP_HOOKS_INTERNAL_ORDERED_WORKER_H_
#define DTRAIN_DDP_HOOKS_INTERNAL_ORDERED_WORKER_H_

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>

#include <ATen/core/ivalue.h>

#include "comm/process_group.h"

namespace dtrain::ddp_hooks::internal {

class OrderedWorker {
 public:
  using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;
  using Job = std::function<FuturePtr()>;

  // The worker of `group`'s process group: one per c10d group while any hook holds it.
  static std::shared_ptr<OrderedWorker> for_group(const comm::Group& group);

  OrderedWorker() = default;
  // Runs the jobs already submitted, then joins the thread.
  ~OrderedWorker();
  OrderedWorker(const OrderedWorker&) = delete;
  OrderedWorker& operator=(const OrderedWorker&) = delete;

  // Runs `job` after every job submitted before it, with the submitting thread's thread-local
  // state (grad mode, autocast, ...) and, for a device tensor `like`, its current stream on that
  // device. Returns a future that completes as the job's future does, or holds the exception the
  // job threw. Blocks while `max_waiting` jobs are waiting to start (a bound on the buckets a
  // lagging worker keeps alive).
  FuturePtr submit(Job job, const at::Tensor& like,
                   size_t max_waiting = std::numeric_limits<size_t>::max());

  // True on any OrderedWorker's thread.
  static bool on_worker_thread();

 private:
  void run();

  std::mutex mu_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::thread thread_;  // started by the first submit
};

}  // namespace dtrain::ddp_hooks::internal

#endif  // DTRAIN_DDP_HOOKS_INTERNAL_ORDERED_WORKER_H_
