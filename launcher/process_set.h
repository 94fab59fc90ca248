// A set of child processes that cannot outlive this one: each runs in its own process group and
// gets SIGKILL when its parent dies, however it dies (PR_SET_PDEATHSIG), and the destructor kills
// and reaps whatever still runs, so an early return or an exception leaves no orphan and no
// zombie. Output comes back through pipes, chunk by chunk. The one spawn-and-reap primitive of
// comm/: the launcher (local_launcher.h) and the test harness (test_harness.h) use it.
//
//   dtrain::comm::ProcessSet set;
//   dtrain::comm::ProcessSpec spec;
//   spec.argv = {"/bin/sh", "-c", "echo rank $RANK"};
//   spec.env = {{"RANK", "0"}};
//   if (absl::Status s = set.start(spec); !s.ok()) return s;
//   std::string out;
//   while (!set.done()) {
//     set.poll(std::chrono::milliseconds(200), [&](int, Pipe, const char* d, size_t n) { out.append(d, n); });
//     for (int i : set.reap()) std::printf("process %d exited with %d\n", i, set.exit_code(i));
//   }
//
// Not thread-safe. Start processes from a thread that outlives them: PR_SET_PDEATHSIG fires when
// the forking thread ends.
#ifndef DTRAIN_LAUNCHER_PROCESS_SET_H_
#define DTRAIN_LAUNCHER_PROCESS_SET_H_

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace dtrain::comm {

// torchrun's default --master_port: node 0's rendezvous on several nodes, and free_port's fallback.
// The one place the number is written.
inline constexpr int kDefaultMasterPort = 29500;

// A TCP port on `addr` (an address of this host or a name resolving to one) that was free a moment
// ago; kDefaultMasterPort when none could be found.
int free_port(const std::string& addr = "127.0.0.1");

struct ProcessSpec {
  // argv[0] is looked up on PATH when it has no '/'. REQUIRES non-empty.
  std::vector<std::string> argv;
  // Set in the child's environment (over this process's), then `unset_env` removed from it.
  std::vector<std::pair<std::string, std::string>> env;
  std::vector<std::string> unset_env;
  // kPipes: stdout and stderr through one pipe each; kMerged: both through the stdout pipe;
  // kInherit: this process's stdout and stderr (a terminal stays a terminal).
  enum class Output { kPipes, kMerged, kInherit };
  Output output = Output::kPipes;
  // Starts the line a child writes to its stderr when it cannot exec argv[0] (then exits 127).
  std::string error_prefix;
};

enum class Pipe { kOut = 0, kErr = 1 };

class ProcessSet {
 public:
  ProcessSet() = default;
  ProcessSet(const ProcessSet&) = delete;
  ProcessSet& operator=(const ProcessSet&) = delete;
  // kill_all().
  ~ProcessSet();

  // Starts one process; its index is the number started before it. The child's SIGINT, SIGTERM,
  // SIGHUP and SIGCHLD are back at their defaults. Internal (with errno's reason) when a pipe or
  // fork fails; the processes already started keep running (the caller decides).
  absl::Status start(const ProcessSpec& spec);

  // Waits up to `timeout` for output from any process or for `wake_fd` (if >= 0) to become
  // readable. Output is handed to on_output as it arrives (chunks, not lines); the end of a pipe
  // is a call with n == 0. Returns whether wake_fd is readable (the caller reads it). Exits do not
  // wake it (the launcher's SIGCHLD handler writes to its wake_fd); without a wake_fd and with no
  // pipe left open it returns within 20 ms, for reap().
  using OutputFn = std::function<void(int index, Pipe pipe, const char* data, size_t n)>;
  bool poll(std::chrono::milliseconds timeout, const OutputFn& on_output, int wake_fd = -1);

  // Reaps, without blocking, the processes that exited since the last call; their indices, in
  // index order.
  std::vector<int> reap();

  int size() const { return static_cast<int>(members_.size()); }
  int num_running() const;
  bool running(int index) const { return members_[index].running; }
  pid_t pid(int index) const { return members_[index].pid; }
  // Exit status, or 128 + signal for a process killed by a signal. REQUIRES !running(index).
  int exit_code(int index) const { return members_[index].code; }
  // The signal that killed the process, 0 when it exited. REQUIRES !running(index).
  int term_signal(int index) const { return members_[index].signal; }
  // Every process reaped and every pipe at its end.
  bool done() const;

  // Sends `sig` to the process group of every process still running.
  void signal_all(int sig);
  // SIGKILL to every process group still running, then reaps them (blocking) and closes the pipes.
  void kill_all();

 private:
  struct Member {
    pid_t pid = -1;
    int fds[2] = {-1, -1};  // by Pipe
    bool running = true;
    int code = 0;
    int signal = 0;
  };
  static void record(Member& m, int status);  // a waitpid status into code and signal
  std::vector<Member> members_;
};

}  // namespace dtrain::comm

#endif  // DTRAIN_LAUNCHER_PROCESS_SET_H_
