#include "comm/testing/replica_processes.h"

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "launcher/process_set.h"

namespace dtrain::comm::testing {
namespace {
constexpr char kReplicaEnv[] = "DTRAIN_TEST_REPLICA";
}  // namespace

bool in_replica_process() { return std::getenv(kReplicaEnv) != nullptr; }

int replica_id() {
  const char* v = std::getenv(kReplicaEnv);
  int id = -1;
  if (v == nullptr || !absl::SimpleAtoi(v, &id)) return -1;
  return id;
}

ReplicaProcesses::ReplicaProcesses() : set_(std::make_unique<ProcessSet>()) {}

ReplicaProcesses::~ReplicaProcesses() { set_->kill_all(); }

absl::StatusOr<int> ReplicaProcesses::start(
    int id, const std::vector<std::pair<std::string, std::string>>& env) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) return absl::FailedPreconditionError("start() outside a test");
  ProcessSpec spec;
  spec.argv = {"/proc/self/exe",
               absl::StrCat("--gtest_filter=", info->test_suite_name(), ".", info->name()),
               "--gtest_brief=1"};
  spec.env = env;
  spec.env.emplace_back(kReplicaEnv, absl::StrCat(id));
  spec.unset_env = {"XML_OUTPUT_FILE", "GTEST_OUTPUT"};  // the parent writes the report
  spec.output = ProcessSpec::Output::kMerged;
  if (absl::Status s = set_->start(spec); !s.ok()) return s;
  output_.emplace_back();
  return set_->size() - 1;
}

bool ReplicaProcesses::wait_for(const std::function<bool()>& pred,
                                std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    set_->reap();
    if (pred()) return true;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    set_->poll(std::min(left, std::chrono::milliseconds(50)),
               [&](int i, Pipe, const char* data, size_t n) { output_[i].append(data, n); });
  }
}

void ReplicaProcesses::signal(int index, int sig) {
  if (set_->running(index)) ::kill(set_->pid(index), sig);
}

bool ReplicaProcesses::stopped(int index) const {
  if (!set_->running(index)) return false;
  std::ifstream in(absl::StrCat("/proc/", set_->pid(index), "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');  // "pid (comm) S ...": the state follows the name
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'T';
}

bool ReplicaProcesses::exited(int index) const { return !set_->running(index); }
int ReplicaProcesses::exit_code(int index) const { return set_->exit_code(index); }
int ReplicaProcesses::term_signal(int index) const { return set_->term_signal(index); }

std::string ReplicaProcesses::outputs() const {
  std::string all;
  for (int i = 0; i < size(); ++i) {
    absl::StrAppend(&all, "--- process ", i, exited(i) ? " (exited)" : " (running)", ":\n",
                    output_[i]);
  }
  return all;
}

}  // namespace dtrain::comm::testing
