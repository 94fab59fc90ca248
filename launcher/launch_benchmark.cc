// What the launcher costs a job: the time launch_local takes to start N ranks of a program that
// exits at once and see them all exit (start-up and teardown, nothing else), and the extra time
// of one restart (every rank fails in the first attempt and succeeds in the second; the row minus
// the start-up row at the same N is the restart's cost). The ranks are /bin/sh, so the rows
// include one shell start per rank; the control row starts N shells directly with fork/exec and
// waits (what any launcher must pay at least).
//
//   ./bazelw run -c opt //launcher:launch_benchmark
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "launcher/local_launcher.h"

namespace dtrain::comm {
namespace {

LaunchOptions options(int nproc, int max_restarts) {
  LaunchOptions o;
  o.nproc_per_node = nproc;
  o.max_restarts = max_restarts;
  o.stop_grace_seconds = 1;
  return o;
}

void run_or_skip(benchmark::State& state, const std::vector<std::string>& argv,
                 const LaunchOptions& o) {
  absl::StatusOr<int> code = launch_local(argv, o);
  if (!code.ok() || *code != 0) {
    state.SkipWithError(code.ok() ? "a rank failed" : std::string(code.status().message()).c_str());
  }
}

void BM_LaunchAndExit(benchmark::State& state) {
  const int nproc = static_cast<int>(state.range(0));
  for (auto _ : state) run_or_skip(state, {"/bin/sh", "-c", "exit 0"}, options(nproc, 0));
  state.counters["ranks"] = nproc;
}
BENCHMARK(BM_LaunchAndExit)->ArgName("nproc")->Arg(1)->Arg(4)->Arg(16)->UseRealTime();

// Every rank fails in attempt 0 (TORCHELASTIC_RESTART_COUNT=0) and exits 0 in attempt 1.
void BM_LaunchOneRestart(benchmark::State& state) {
  const int nproc = static_cast<int>(state.range(0));
  for (auto _ : state) {
    run_or_skip(state, {"/bin/sh", "-c", "test \"$TORCHELASTIC_RESTART_COUNT\" != 0"},
                options(nproc, 1));
  }
  state.counters["ranks"] = nproc;
}
BENCHMARK(BM_LaunchOneRestart)->ArgName("nproc")->Arg(1)->Arg(4)->Arg(16)->UseRealTime();

// Control: N shells forked and waited for, no launcher.
void BM_ForkExecControl(benchmark::State& state) {
  const int nproc = static_cast<int>(state.range(0));
  for (auto _ : state) {
    std::vector<pid_t> pids;
    for (int i = 0; i < nproc; ++i) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::execl("/bin/sh", "sh", "-c", "exit 0", static_cast<char*>(nullptr));
        ::_exit(127);
      }
      pids.push_back(pid);
    }
    for (pid_t pid : pids) ::waitpid(pid, nullptr, 0);
  }
  state.counters["ranks"] = nproc;
}
BENCHMARK(BM_ForkExecControl)->ArgName("nproc")->Arg(1)->Arg(4)->Arg(16)->UseRealTime();

}  // namespace
}  // namespace dtrain::comm

BENCHMARK_MAIN();
