#include "comm/process_group.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/testing/test_harness.h"
#include "testing/test_util.h"

namespace dtrain::comm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::run_ranks_as_processes;
using testing::run_ranks_as_threads;

// Sets environment variables for one test and restores them after.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const char* name : {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"}) {
      const char* v = std::getenv(name);
      saved_.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
      ::unsetenv(name);
    }
    for (auto [k, v] : vars) ::setenv(k, v, 1);
  }
  ~ScopedEnv() {
    for (auto& [k, v] : saved_) {
      if (v)
        ::setenv(k.c_str(), v->c_str(), 1);
      else
        ::unsetenv(k.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST(ProcessGroupTest, AllReduceOverThreads) {
  run_ranks_as_threads(3, [](Group& g) {
    EXPECT_EQ(g.size(), 3);
    EXPECT_EQ(g.world_rank(), g.rank());
    EXPECT_THAT(g.global_ranks(), ElementsAre(0, 1, 2));
    std::vector<at::Tensor> t = {at::full({4}, g.rank() + 1.0)};
    g->allreduce(t)->wait();
    EXPECT_TRUE(t[0].equal(at::full({4}, 6.0)));
  });
}

TEST(ProcessGroupTest, EnvRendezvousOverProcesses) {
  run_ranks_as_processes(2, [](Group& g) {
    EXPECT_EQ(g.size(), 2);
    EXPECT_EQ(g.local_rank(), g.rank());  // the harness sets LOCAL_RANK = RANK
    std::vector<at::Tensor> t = {at::full({8}, static_cast<double>(g.rank()))};
    if (g.rank() == 0) t[0].fill_(42);
    g->broadcast(t)->wait();
    EXPECT_TRUE(t[0].equal(at::full({8}, 42.0)));
  });
}

TEST(ProcessGroupTest, FileRendezvous) {
  char dir[] = "/tmp/dtrain_file_store_XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string url = std::string("file://") + dir + "/store";
  std::vector<std::thread> threads;
  std::vector<double> sums(2);
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      InitOptions o;
      o.init_method = url + "?world_size=2";
      o.rank = rank;
      o.timeout = std::chrono::seconds(30);
      auto g = init_process_group(o);
      ASSERT_TRUE(g.ok()) << g.status();
      std::vector<at::Tensor> t = {at::ones({2})};
      (*g)->allreduce(t)->wait();
      sums[rank] = t[0].sum().item<double>();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_THAT(sums, ElementsAre(4.0, 4.0));
}

TEST(ProcessGroupTest, MissingEnvVariableIsNamed) {
  ScopedEnv env({{"MASTER_PORT", "29500"}, {"RANK", "0"}, {"WORLD_SIZE", "1"}});
  auto g = init_process_group(InitOptions{});
  EXPECT_EQ(g.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(g.status().message()),
              HasSubstr("environment variable MASTER_ADDR expected, but not set"));
  ScopedEnv env2({{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}, {"WORLD_SIZE", "1"}});
  auto g2 = init_process_group(InitOptions{});
  EXPECT_EQ(g2.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(g2.status().message()), HasSubstr("environment variable RANK expected"));
}

TEST(ProcessGroupTest, MalformedEnvValuesAreNamed) {
  ScopedEnv env(
      {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "http"}, {"RANK", "0"}, {"WORLD_SIZE", "1"}});
  auto g = init_process_group(InitOptions{});
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(g.status().message()),
              HasSubstr("environment variable MASTER_PORT='http' is not an integer in [1, 65535]"));
}

TEST(ProcessGroupTest, RankBeyondWorldSize) {
  ScopedEnv env(
      {{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}, {"RANK", "2"}, {"WORLD_SIZE", "2"}});
  auto g = init_process_group(InitOptions{});
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("RANK=2 must be in [0, WORLD_SIZE=2)"));
}

TEST(ProcessGroupTest, UnreachableMasterTimesOutNamingAddress) {
  const int port = testing::free_port();  // nobody listens there
  InitOptions o;
  o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  o.rank = 1;
  o.world_size = 2;
  o.timeout = std::chrono::milliseconds(1500);
  auto g = init_process_group(o);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kDeadlineExceeded) << g.status();
  EXPECT_THAT(std::string(g.status().message()),
              HasSubstr("cannot reach the master 127.0.0.1:" + std::to_string(port)));
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("connection refused"));
}

// The local addresses (hex, as /proc/net/tcp and tcp6 write them) of sockets listening on `port`.
std::vector<std::string> listeners_on(int port) {
  std::vector<std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    FILE* f = std::fopen(table, "r");
    if (f == nullptr) continue;
    char line[512];
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      char local[64] = {0}, remote[64] = {0};
      unsigned state = 0;
      if (std::sscanf(line, " %*d: %63s %63s %x", local, remote, &state) != 3 || state != 0x0A)
        continue;
      const std::string l = local;
      const size_t colon = l.find(':');
      if (colon != std::string::npos && std::stoi(l.substr(colon + 1), nullptr, 16) == port)
        out.push_back(l.substr(0, colon));
    }
    std::fclose(f);
  }
  return out;
}

TEST(ProcessGroupTest, StoreListensOnlyOnTheMastersInterface) {
  const int port = testing::free_port();
  InitOptions o;
  o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  o.rank = 0;
  o.world_size = 1;
  o.timeout = std::chrono::seconds(20);
  auto g = init_process_group(o);
  ASSERT_TRUE(g.ok()) << g.status();
  const std::vector<std::string> listening = listeners_on(port);
  ASSERT_FALSE(listening.empty()) << "nothing listens on the store's port " << port;
  if (!kTcpStoreTakesListenFd) {
    GTEST_SKIP() << "LibTorch " << kLibTorchVersion
                 << "'s TCPStore listens on every interface (README, Security)";
  }
  for (const std::string& addr : listening)
    EXPECT_EQ(addr, "0100007F") << "the store listens beyond loopback";
}

TEST(ProcessGroupTest, MissingPeerTimesOut) {
  InitOptions o;
  o.init_method = "tcp://127.0.0.1:" + std::to_string(testing::free_port());
  o.rank = 0;
  o.world_size = 2;  // rank 1 never comes
  o.timeout = std::chrono::milliseconds(1500);
  auto g = init_process_group(o);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kDeadlineExceeded) << g.status();
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("rank 1 of 2 never arrived"));
}

TEST(ProcessGroupTest, BackendErrors) {
  InitOptions o;
  o.backend = "mpi";
  EXPECT_THAT(
      std::string(init_process_group(o).status().message()),
      HasSubstr("unknown backend \"mpi\": use \"gloo\", \"nccl\" or \"cpu:gloo,cuda:nccl\""));
  for (const char* bad : {"cpu:gloo,cuda:mpi", "cpu:nccl,cuda:gloo", "cpu:gloo", "gloo,nccl"}) {
    o.backend = bad;
    EXPECT_EQ(init_process_group(o).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  if (nccl_available()) {
    GTEST_SKIP() << "NCCL is built in; this checks the CPU-only build's error";
  }
  // NCCL alone and one backend per device type (either order) need a CUDA build.
  for (const char* needs_cuda : {"nccl", "cpu:gloo,cuda:nccl", "cuda:nccl, cpu:gloo"}) {
    o.backend = needs_cuda;
    auto g = init_process_group(o);
    EXPECT_EQ(g.status().code(), absl::StatusCode::kUnimplemented) << needs_cuda;
    EXPECT_THAT(std::string(g.status().message()), HasSubstr("built against a CPU-only LibTorch"))
        << needs_cuda;
  }
}

TEST(ProcessGroupTest, BadInitMethod) {
  InitOptions o;
  o.init_method = "tcp://nohostport";
  o.rank = 0;
  o.world_size = 1;
  EXPECT_THAT(std::string(init_process_group(o).status().message()),
              HasSubstr("must be tcp://HOST:PORT"));
  o.init_method = "ftp://x";
  EXPECT_THAT(std::string(init_process_group(o).status().message()),
              HasSubstr("unknown init_method 'ftp://x'"));
  o.init_method = "tcp://127.0.0.1:1234";
  o.rank = -1;
  EXPECT_THAT(std::string(init_process_group(o).status().message()),
              HasSubstr("tcp:// needs InitOptions rank and world_size"));
}

TEST(SubgroupTest, ConsecutiveSubgroupsReduceSeparately) {
  run_ranks_as_threads(4, [](Group& world) {
    auto sub = new_subgroups(world, 2);
    ASSERT_TRUE(sub.ok()) << sub.status();
    ASSERT_EQ(sub->all.size(), 2u);
    const int mine = world.rank() / 2;
    EXPECT_TRUE(sub->mine.is_member());
    EXPECT_EQ(sub->mine.rank(), world.rank() % 2);
    EXPECT_THAT(sub->mine.global_ranks(), ElementsAre(2 * mine, 2 * mine + 1));
    EXPECT_FALSE(sub->all[1 - mine].is_member());
    EXPECT_THAT(sub->all[1 - mine].global_ranks(), ElementsAre(2 * (1 - mine), 2 * (1 - mine) + 1));
    std::vector<at::Tensor> t = {at::full({1}, static_cast<double>(world.rank()))};
    sub->mine->allreduce(t)->wait();
    EXPECT_EQ(t[0].item<double>(), mine == 0 ? 1.0 : 5.0);
    // A subgroup of a subgroup maps back to world ranks.
    auto single = new_group(sub->mine, {1});
    ASSERT_TRUE(single.ok());
    EXPECT_THAT(single->global_ranks(), ElementsAre(2 * mine + 1));
    EXPECT_EQ(single->is_member(), world.rank() % 2 == 1);
  });
}

TEST(SubgroupTest, ArbitraryRankSubset) {
  run_ranks_as_threads(3, [](Group& world) {
    auto g = new_group(world, {2, 0});
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_THAT(g->global_ranks(), ElementsAre(0, 2));
    if (world.rank() == 1) {
      EXPECT_FALSE(g->is_member());
      return;
    }
    std::vector<at::Tensor> t = {at::ones({1})};
    (*g)->allreduce(t)->wait();
    EXPECT_EQ(t[0].item<double>(), 2.0);
    EXPECT_EQ(g->global_rank(g->rank()), world.rank());
  });
}

TEST(SubgroupTest, ValidationErrors) {
  run_ranks_as_threads(2, [](Group& world) {
    EXPECT_THAT(std::string(new_subgroups(world, 3).status().message()),
                HasSubstr("group_size 3 must be in [1, 2]"));
    EXPECT_THAT(std::string(new_group(world, {0, 0}).status().message()),
                HasSubstr("rank 0 is listed twice"));
    EXPECT_THAT(std::string(new_group(world, {5}).status().message()),
                HasSubstr("rank 5 is out of range"));
    EXPECT_THAT(std::string(new_subgroups_by_enumeration(world, {{0, 1}, {1}}).status().message()),
                HasSubstr("Rank 1 has appeared in both subgroup 0 and 1"));
  });
}

// barrier: no member leaves it before the last arrives; device ids mean nothing to Gloo.
TEST(ProcessGroupTest, BarrierHoldsEveryRankUntilTheLastArrives) {
  std::atomic<int> arrived{0};
  run_ranks_as_threads(3, [&](Group& g) {
    if (g.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ++arrived;
    barrier(g, g.rank() == 1 ? std::vector<int64_t>{7} : std::vector<int64_t>{})->wait();
    EXPECT_EQ(arrived.load(), 3) << "rank " << g.rank() << " left the barrier early";
  });
}

// destroy_process_group: the group, its copies and every group made from it refuse use, naming the
// call; the groups it was not made from keep working; a second call is a no-op.
TEST(SubgroupTest, DestroyedGroupsRefuseUseNamingTheCall) {
  run_ranks_as_threads(4, [](Group& world) {
    auto pairs = new_subgroups(world, 2);
    ASSERT_TRUE(pairs.ok()) << pairs.status();
    auto single = new_group(pairs->mine, {0});  // made from this rank's pair
    ASSERT_TRUE(single.ok()) << single.status();
    const std::string destroyed = "was destroyed by destroy_process_group";
    destroy_process_group(pairs->all[0]);  // ranks 0 and 1's pair (a non-member's copy elsewhere)
    std::vector<at::Tensor> t = {at::ones({1})};
    world->allreduce(t)->wait();
    EXPECT_EQ(t[0].item<double>(), 4.0);
    if (world.rank() < 2) {
      test_util::expect_error([&] { (void)pairs->mine.size(); }, destroyed);
      if (single->is_member()) test_util::expect_error([&] { (void)single->rank(); }, destroyed);
    } else {
      EXPECT_EQ(pairs->mine.size(), 2);
      if (single->is_member()) EXPECT_EQ(single->size(), 1);
    }
    const Group copy = world;
    destroy_process_group(world);
    destroy_process_group(world);
    test_util::expect_error([&] { (void)copy.rank(); }, destroyed);
    test_util::expect_error([&] { (void)pairs->mine.rank(); }, destroyed);
    if (single->is_member()) test_util::expect_error([&] { (void)single->size(); }, destroyed);
    test_util::expect_error([&] { destroy_process_group(Group()); }, "default-constructed Group");
  });
}

// destroy_process_group's shutdown reaches a backend's own shutdown() through C10dGroup& (on every
// LibTorch whose Backend has one; libtorch_compat.h asserts 2.11 on have it).
TEST(SubgroupTest, ShutdownReachesTheBackendsOverride) {
  if (!kBackendHasShutdown) GTEST_SKIP() << "this LibTorch's c10d::Backend has no shutdown()";
  struct Fake final : C10dGroup {
    Fake() : C10dGroup(0, 1) {}
    const std::string getBackendName() const override { return "fake"; }
    void shutdown() { down = true; }  // overrides where Backend::shutdown exists
    bool down = false;
  };
  auto fake = c10::make_intrusive<Fake>();
  shutdown_backend(static_cast<C10dGroup&>(*fake));
  EXPECT_TRUE(fake->down);
}

// A one-rank Gloo group on an in-process store, then a write into a pipe nobody reads: the write
// must fail with EPIPE instead of killing the process (it exits 0 when it fails, 1 when it wrote).
[[noreturn]] void init_then_write_to_a_closed_pipe() {
  InitOptions o;
  o.store = c10::make_intrusive<c10d::HashStore>();
  o.rank = 0;
  o.world_size = 1;
  absl::StatusOr<Group> g = init_process_group(o);
  if (!g.ok()) ::_exit(2);
  int fds[2];
  if (::pipe(fds) != 0) ::_exit(3);
  ::close(fds[0]);
  const ssize_t n = ::write(fds[1], "x", 1);
  ::_exit(n == -1 && errno == EPIPE ? 0 : 1);
}

TEST(ProcessGroupTest, AWriteToADeadPeerIsAnErrorNotSigpipe) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(init_then_write_to_a_closed_pipe(), ::testing::ExitedWithCode(0), "");
}

int g_sigpipes = 0;
void count_sigpipe(int) { ++g_sigpipes; }

TEST(ProcessGroupTest, TheProgramsOwnSigpipeHandlerIsKept) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ::signal(SIGPIPE, count_sigpipe);
        ignore_sigpipe();
        int fds[2];
        if (::pipe(fds) != 0) ::_exit(3);
        ::close(fds[0]);
        [[maybe_unused]] const ssize_t n = ::write(fds[1], "x", 1);
        ::_exit(g_sigpipes == 1 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(HarnessTest, HungCollectiveFailsWithinTimeout) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NONFATAL_FAILURE(run_ranks_as_threads(
                              2,
                              [](Group& g) {
                                if (g.rank() == 0) {
                                  std::vector<at::Tensor> t = {at::ones({1})};
                                  g->allreduce(t)->wait();  // rank 1 never joins
                                } else {
                                  std::this_thread::sleep_for(std::chrono::seconds(4));
                                }
                              },
                              testing::HarnessOptions{std::chrono::seconds(2)}),
                          "rank 0: ");
  // Not a hang: rank 1's 4 s, 10x over, a bound a loaded machine cannot miss.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(40));
}

TEST(HarnessTest, ThrowingRankIsReported) {
  EXPECT_NONFATAL_FAILURE(run_ranks_as_threads(2,
                                               [](Group& g) {
                                                 if (g.rank() == 1)
                                                   throw std::runtime_error("boom");
                                               }),
                          "rank 1: boom");
}

TEST(HarnessTest, FailingProcessIsReported) {
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    run_ranks_as_processes(2, [](Group& g) {
      if (g.rank() == 1) throw std::runtime_error("process boom");
    });
  }
  ASSERT_EQ(results.size(), 1);
  EXPECT_THAT(results.GetTestPartResult(0).message(), HasSubstr("rank 1 exited with code 1"));
  EXPECT_THAT(results.GetTestPartResult(0).message(), HasSubstr("process boom"));
}

}  // namespace
}  // namespace dtrain::comm
