#include "comm/rendezvous_checks.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/process_group.h"
#include "comm/test_harness.h"

namespace dtrain::comm {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A socket that accepts connections (the kernel's backlog does) and never says a word.
struct SilentListener {
  int fd = -1;
  int port = 0;
  SilentListener() {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    EXPECT_EQ(::listen(fd, 16), 0);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
  }
  ~SilentListener() { ::close(fd); }
};

InitOptions tcp(int port, int rank, int world, std::chrono::milliseconds timeout) {
  InitOptions o;
  o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  o.rank = rank;
  o.world_size = world;
  o.timeout = timeout;
  return o;
}

TEST(RendezvousChecksTest, NothingListeningIsRefusedNotAHang) {
  const int port = testing::free_port();
  const auto t0 = Clock::now();
  absl::Status s = wait_for_listener("127.0.0.1", port, Clock::now() + std::chrono::milliseconds(700));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(s.message()), HasSubstr("connection refused: nothing listens there"));
  EXPECT_LT(seconds_since(t0), 3);
  SilentListener l;
  EXPECT_TRUE(wait_for_listener("127.0.0.1", l.port, Clock::now() + std::chrono::seconds(2)).ok());
  EXPECT_EQ(wait_for_listener("no-such-host.invalid", 1, Clock::now() + std::chrono::seconds(1)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RendezvousChecksTest, AMasterPortThatAcceptsAndNeverAnswersEndsByTheDeadline) {
  // Never closed: the abandoned store client stays blocked on it until the test process ends
  // (closing it would make LibTorch's client throw on a thread it owns).
  static SilentListener& l = *new SilentListener();
  const auto t0 = Clock::now();
  auto g = init_process_group(tcp(l.port, 1, 2, std::chrono::milliseconds(1500)));
  EXPECT_EQ(g.status().code(), absl::StatusCode::kDeadlineExceeded) << g.status();
  EXPECT_LT(seconds_since(t0), 6) << g.status();
}

TEST(RendezvousChecksTest, ALoneRankZeroNamesTheMissingRanksWithinItsTimeout) {
  const auto t0 = Clock::now();
  auto g = init_process_group(tcp(testing::free_port(), 0, 3, std::chrono::milliseconds(1500)));
  EXPECT_EQ(g.status().code(), absl::StatusCode::kDeadlineExceeded) << g.status();
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("ranks 1, 2 of 3 never arrived"));
  EXPECT_LT(seconds_since(t0), 4);  // one timeout, not two
}

TEST(RendezvousChecksTest, WorldSizeMismatchIsNamed) {
  const int port = testing::free_port();
  absl::Status rank1;
  std::thread other([&] { rank1 = init_process_group(tcp(port, 1, 3, std::chrono::seconds(3))).status(); });
  auto g0 = init_process_group(tcp(port, 0, 2, std::chrono::seconds(3)));
  other.join();
  EXPECT_EQ(rank1.code(), absl::StatusCode::kInvalidArgument) << rank1;
  EXPECT_THAT(std::string(rank1.message()), HasSubstr("has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2"));
  EXPECT_FALSE(g0.ok());  // its peer left: Gloo's connect fails within the timeout
}

TEST(RendezvousChecksTest, TwoProcessesWithOneRankAreNamed) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const Deadline d = Clock::now() + std::chrono::seconds(1);
  absl::Status a;
  std::thread first([&] { a = check_arrivals(*store, 1, 2, d, "test"); });
  absl::Status b = check_arrivals(*store, 1, 2, d, "test");
  first.join();
  // Whichever announced second is told; the other waits for rank 0 and times out.
  ASSERT_NE(absl::IsInvalidArgument(a), absl::IsInvalidArgument(b)) << a << " / " << b;
  const absl::Status& dup = absl::IsInvalidArgument(a) ? a : b;
  EXPECT_THAT(std::string(dup.message()), HasSubstr("2 processes started with RANK=1"));
}

TEST(RendezvousChecksTest, AllArrivedReturnsAtOnce) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const Deadline d = Clock::now() + std::chrono::seconds(5);
  std::vector<std::thread> ranks;
  std::vector<absl::Status> out(3);
  for (int r = 0; r < 3; ++r) ranks.emplace_back([&, r] { out[r] = check_arrivals(*store, r, 3, d, "test"); });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(out[r].ok()) << r << ": " << out[r];
}

}  // namespace
}  // namespace dtrain::comm
