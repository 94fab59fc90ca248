// The steps of a rendezvous that can hang, each under a deadline that is enforced here (not left to
// LibTorch), each failure naming its real cause: nothing listening at MASTER_ADDR:MASTER_PORT, a
// host that cannot be reached, a listener that is not a c10d store, ranks that never arrived, a
// WORLD_SIZE that differs between ranks, two processes with one RANK. Used by
// comm::init_process_group; exposed for tests and for layers with their own rendezvous.
//
//   const auto deadline = std::chrono::steady_clock::now() + timeout;
//   if (absl::Status s = wait_for_listener("10.0.0.1", 29500, deadline); !s.ok()) return s;
//   absl::StatusOr<Store> store = run_with_deadline<Store>([&] { return make_store(); }, deadline, "...");
//   if (absl::Status s = check_arrivals(*store, rank, world_size, deadline); !s.ok()) return s;
#ifndef DTRAIN_COMM_RENDEZVOUS_CHECKS_H_
#define DTRAIN_COMM_RENDEZVOUS_CHECKS_H_

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace dtrain::comm {

using Deadline = std::chrono::steady_clock::time_point;

// A duration for a message, in seconds to a tenth: "20 s" (also for 19999 ms, what a 20 s
// deadline measures from a moment after it was set), "0.4 s", "1.5 s".
inline std::string seconds_text(std::chrono::milliseconds d) {
  return absl::StrCat(static_cast<double>((d.count() + 50) / 100) / 10, " s");
}

// Returns once a TCP connection to host:port succeeds (it is closed again at once), retrying until
// `deadline`. DeadlineExceeded naming host:port and the last error ("connection refused: nothing
// listens there yet", "no route to host", "timed out"); InvalidArgument when the host does not
// resolve.
absl::Status wait_for_listener(const std::string& host, int port, Deadline deadline);

// Runs fn() on a helper thread and waits for it until `deadline`. When fn() has not returned by
// then, returns DeadlineExceeded("<what> did not finish within N s"), N being how long this call
// waited (seconds_text), and abandons the thread (detached, still holding what fn captured by value: capture by
// value or shared_ptr only); callers add what to check. An exception from fn() is returned as
// Unavailable with its message.
template <typename T>
absl::StatusOr<T> run_with_deadline(std::function<absl::StatusOr<T>()> fn, Deadline deadline,
                                    const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  auto promise = std::make_shared<std::promise<absl::StatusOr<T>>>();
  std::future<absl::StatusOr<T>> result = promise->get_future();
  std::thread([promise, fn = std::move(fn)]() mutable {
    try {
      promise->set_value(fn());
    } catch (const std::exception& e) {
      promise->set_value(absl::UnavailableError(e.what()));
    }
  }).detach();
  if (result.wait_until(deadline) != std::future_status::ready) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - start);
    return absl::DeadlineExceededError(
        absl::StrCat(what, " did not finish within ", seconds_text(waited)));
  }
  return result.get();
}

// Every rank announces itself (its rank and WORLD_SIZE) on `store` and waits until all
// `world_size` ranks have, polling until `deadline`. Errors: InvalidArgument when another process
// announced the same rank, or when any rank in [0, world_size) announced another WORLD_SIZE: then
// every rank that sees the difference fails at once, naming the ranks whose WORLD_SIZE differs
// and the ranks not arrived yet, and rank 0 (whose process serves a TCPStore) first waits up to 5 s
// (never past `deadline`) for the ranks that arrived to read their verdict; DeadlineExceeded naming
// the ranks that never arrived. `what` names the rendezvous in messages ("rendezvous on
// 10.0.0.1:29500"). Store errors throw, as the store's calls do.
absl::Status check_arrivals(c10d::Store& store, int rank, int world_size, Deadline deadline,
                            const std::string& what);

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_RENDEZVOUS_CHECKS_H_
