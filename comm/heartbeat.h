// Heartbeats: every rank bumps its counter on the job's rendezvous store from a background thread,
// so that when a collective fails or times out the error can name the rank that stopped: a
// process that is stopped (SIGSTOP), hung in the kernel, swapped out or dead stops beating; PyTorch
// users get this from NCCL's watchdog and monitored_barrier.
//
//   dtrain::comm::Heartbeat heartbeat(world);            // starts beating (default every 2 s)
//   try { train(); } catch (const std::exception& e) {
//     std::cerr << e.what() << "; " << heartbeat.describe_stalls() << "\n";
//     // "... Timed out waiting 60000ms ...; rank 1 stopped responding (no heartbeat for 6 s)"
//   }
//
// The thread uses its own connection to a TCP store (c10d's client is not thread-safe), adds one
// small message per period per rank, and never blocks the training thread. Thread safety: all
// methods may be called from any thread.
#ifndef DTRAIN_COMM_HEARTBEAT_H_
#define DTRAIN_COMM_HEARTBEAT_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/process_group.h"

namespace dtrain::comm {

class Heartbeat {
 public:
  // REQUIRES: `world` is the world group (its ranks are the job's). Starts the thread.
  explicit Heartbeat(const Group& world,
                     std::chrono::milliseconds period = std::chrono::seconds(2));
  // Stops beating (the thread ends within one period; it never delays this destructor).
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // The ranks (other than this one) whose counter did not move over three periods. Takes three
  // periods. Unavailable when the store does not answer within them.
  absl::StatusOr<std::vector<int>> stalled_ranks() const;

  // "rank 1 stopped responding (no heartbeat for 6 s)", "ranks 1, 3 stopped responding (...)",
  // "every rank is alive (heartbeats continue)", or what kept it from knowing.
  std::string describe_stalls() const;

  struct Shared;

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace dtrain::comm

#endif  // DTRAIN_COMM_HEARTBEAT_H_
