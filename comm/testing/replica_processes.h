// Replica groups as processes of this test binary, for fault tests that kill one and start it
// again (testonly): each child re-executes the binary restricted to the current test with
// DTRAIN_TEST_REPLICA set, so the test body runs its replica's part when in_replica_process().
// Unlike run_ranks_as_processes, the children share no rendezvous: they meet where the test says
// (a comm::Lighthouse the parent runs), and a child can be started again under the same id.
//
//   if (in_replica_process()) { run_replica(...); std::_Exit(0); }
//   dtrain::comm::testing::ReplicaProcesses replicas;
//   replicas.start(0, {{"PORT", port}});                   // index 0
//   bool ok = replicas.wait_for([&] { return replicas.exited(0); }, deadline);
//   std::cout << replicas.output(0);
//
// Children never outlive the test process (launcher/process_set.h). Not thread-safe.
#ifndef DTRAIN_COMM_TESTING_REPLICA_PROCESSES_H_
#define DTRAIN_COMM_TESTING_REPLICA_PROCESSES_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dtrain::comm {
class ProcessSet;
}

namespace dtrain::comm::testing {

// True inside a child started by ReplicaProcesses; replica_id() is its id (-1 elsewhere).
bool in_replica_process();
int replica_id();

class ReplicaProcesses {
 public:
  ReplicaProcesses();
  ~ReplicaProcesses();  // kills and reaps the children still running

  // Starts replica `id` (DTRAIN_TEST_REPLICA=id) with `env` added; returns its index (0, 1, ...
  // in start order: a restarted replica gets a new index). stdout and stderr merged.
  absl::StatusOr<int> start(int id, const std::vector<std::pair<std::string, std::string>>& env);

  // Collects output and exits until pred() holds (true) or `deadline` passes (false).
  bool wait_for(const std::function<bool()>& pred, std::chrono::steady_clock::time_point deadline);

  // Sends `sig` to process `index` (SIGSTOP / SIGCONT: a replica cut off for a while), if running.
  void signal(int index, int sig);

  // Whether process `index` is stopped (SIGSTOP; /proc/PID/stat says 'T').
  bool stopped(int index) const;

  const std::string& output(int index) const { return output_[index]; }
  // Every process's output under a "--- process I (exited|running):" line: for failure messages.
  std::string outputs() const;
  bool exited(int index) const;
  // 128 + signal for a process killed by a signal. REQUIRES exited(index).
  int exit_code(int index) const;
  int term_signal(int index) const;
  int size() const { return static_cast<int>(output_.size()); }

 private:
  std::unique_ptr<ProcessSet> set_;
  std::vector<std::string> output_;
};

}  // namespace dtrain::comm::testing

#endif  // DTRAIN_COMM_TESTING_REPLICA_PROCESSES_H_
