#include "comm/testing/test_harness.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "absl/strings/str_cat.h"
#include "comm/exception_status.h"
#include "comm/libtorch_compat.h"
#include "launcher/process_set.h"

namespace dtrain::comm::testing {
namespace {

constexpr char kRankEnv[] = "DTRAIN_TEST_RANK";

// Ranks as threads are many process groups in one process, making their first collectives at
// once: where c10d's flight recorder races on that (comm/libtorch_compat.h), it is turned off
// before anything can start it, unless the caller set TORCH_FR_BUFFER_SIZE.
[[maybe_unused]] const bool kFlightRecorderOff = [] {
  if constexpr (kFlightRecorderRacesOnNewGroups) ::setenv("TORCH_FR_BUFFER_SIZE", "0", 0);
  return true;
}();

std::string describe(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (...) {
    return current_exception_message();
  }
}

}  // namespace

bool in_rank_process() { return std::getenv(kRankEnv) != nullptr; }

int free_port() { return comm::free_port(); }

void run_ranks_as_threads(int world_size, const RankFn& fn, const HarnessOptions& options) {
  ASSERT_GE(world_size, 1);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  std::vector<std::string> errors(world_size);
  std::vector<bool> done(world_size, false);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      std::string error;
      try {
        InitOptions o;
        o.backend = options.backend;
        o.rank = rank;
        o.world_size = world_size;
        o.store = store;
        o.timeout = options.timeout;
        o.gloo_hostname = "127.0.0.1";
        absl::StatusOr<Group> g = init_process_group(o);
        if (!g.ok()) {
          error = absl::StrCat("init_process_group: ", g.status().ToString());
        } else {
          fn(*g);
        }
      } catch (...) {
        error = describe(std::current_exception());
      }
      std::lock_guard<std::mutex> lock(mu);
      errors[rank] = error;
      done[rank] = true;
      ++finished;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    const bool all =
        cv.wait_for(lock, options.timeout + options.grace, [&] { return finished == world_size; });
    if (!all) {
      std::string hung;
      for (int r = 0; r < world_size; ++r)
        if (!done[r]) absl::StrAppend(&hung, hung.empty() ? "" : ", ", r);
      std::cerr << "FAILED: rank(s) " << hung << " still running "
                << (options.timeout + options.grace).count()
                << " ms after start (a hung collective?); ending the test process\n";
      for (int r = 0; r < world_size; ++r)
        if (done[r] && !errors[r].empty()) std::cerr << "rank " << r << ": " << errors[r] << "\n";
      std::cerr.flush();
      std::_Exit(1);
    }
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world_size; ++r) {
    if (!errors[r].empty()) ADD_FAILURE() << "rank " << r << ": " << errors[r];
  }
}

namespace {

// A child of run_ranks_as_processes: be rank RANK (from the environment the parent set), then
// leave without running the rest of the test binary.
[[noreturn]] void run_as_child_rank(const RankFn& fn, const HarnessOptions& options) {
  int code = 0;
  try {
    InitOptions o;
    o.backend = options.backend;
    o.timeout = options.timeout;
    absl::StatusOr<Group> g = init_process_group(o);
    if (!g.ok()) {
      std::cerr << "init_process_group: " << g.status() << "\n";
      code = 1;
    } else {
      fn(*g);
      if (::testing::Test::HasFailure()) code = 1;
    }
  } catch (...) {
    std::cerr << describe(std::current_exception()) << "\n";
    code = 1;
  }
  std::cout.flush();
  std::cerr.flush();
  std::_Exit(code);
}

}  // namespace

void run_ranks_as_processes(int world_size, const RankFn& fn, const HarnessOptions& options) {
  if (in_rank_process()) run_as_child_rank(fn, options);

  ASSERT_GE(world_size, 1);
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  ASSERT_NE(info, nullptr);
  const std::string filter =
      absl::StrCat("--gtest_filter=", info->test_suite_name(), ".", info->name());
  const std::string port = std::to_string(free_port());

  // Killed and reaped however this returns (an ASSERT included): no rank outlives its test.
  ProcessSet children;
  std::vector<std::string> output(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    const std::string r = std::to_string(rank);
    const std::string w = std::to_string(world_size);
    ProcessSpec spec;
    spec.argv = {"/proc/self/exe", filter, "--gtest_brief=1"};
    spec.env = {{kRankEnv, r},           {"RANK", r},
                {"LOCAL_RANK", r},       {"WORLD_SIZE", w},
                {"LOCAL_WORLD_SIZE", w}, {"MASTER_ADDR", "127.0.0.1"},
                {"MASTER_PORT", port}};
    // Children of a test must not write the parent's XML report.
    spec.unset_env = {"XML_OUTPUT_FILE", "GTEST_OUTPUT"};
    spec.output = ProcessSpec::Output::kMerged;
    const absl::Status started = children.start(spec);
    ASSERT_TRUE(started.ok()) << "rank " << rank << ": " << started;
  }

  const auto deadline = std::chrono::steady_clock::now() + options.timeout + options.grace;
  bool timed_out = false;
  while (!children.done()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    children.poll(std::min(left, std::chrono::milliseconds(1000)),
                  [&](int r, Pipe, const char* data, size_t n) { output[r].append(data, n); });
    children.reap();
  }
  children.kill_all();  // after a timeout: the hung ranks; otherwise nothing is left running
  for (int r = 0; r < world_size; ++r) {
    const int code = children.exit_code(r);
    if (timed_out) {
      ADD_FAILURE() << "rank " << r << " still running "
                    << (options.timeout + options.grace).count()
                    << " ms after start (hung?); killed. Output:\n"
                    << output[r];
    } else if (children.term_signal(r) != 0) {
      ADD_FAILURE() << "rank " << r << " died of signal " << children.term_signal(r)
                    << ". Output:\n"
                    << output[r];
    } else if (code != 0) {
      ADD_FAILURE() << "rank " << r << " exited with code " << code << ". Output:\n" << output[r];
    }
  }
}

}  // namespace dtrain::comm::testing
