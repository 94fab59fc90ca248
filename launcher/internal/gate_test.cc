#include "launcher/internal/gate.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "launcher/internal/line_conn.h"
#include "launcher/process_set.h"

namespace dtrain::comm::internal {
namespace {

using ::testing::ElementsAre;
using ::testing::StartsWith;
using namespace std::chrono_literals;

// A blocking client socket connected to 127.0.0.1:port; reads give up after 30 s (a gate that never
// answers fails the test instead of hanging it).
int client(int port) {
  absl::StatusOr<int> fd = connect_to("127.0.0.1", port);
  EXPECT_TRUE(fd.ok()) << fd.status();
  if (!fd.ok()) return -1;
  ::fcntl(*fd, F_SETFL, 0);
  timeval tv{30, 0};
  ::setsockopt(*fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return *fd;
}

void write_all(int fd, const std::string& bytes) {
  EXPECT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
}

// Everything the peer sends until it ends its stream.
std::string read_to_end(int fd) {
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
  return out;
}

// Calls gate.arrivals() (after polling its sockets) until some arrive.
std::vector<Arrival> wait_for_arrivals(Gate& gate) {
  for (int round = 0; round < 300; ++round) {
    std::vector<pollfd> fds;
    gate.add_fds(fds);
    ::poll(fds.data(), fds.size(), 100);
    std::vector<Arrival> a = gate.arrivals();
    if (!a.empty()) return a;
  }
  ADD_FAILURE() << "nothing arrived";
  return {};
}

class GateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    port_ = free_port("127.0.0.1");
    absl::StatusOr<int> fd = listen_on("127.0.0.1", port_);
    ASSERT_TRUE(fd.ok()) << fd.status();
    gate_ = std::make_unique<Gate>(*fd, 100ms, 1s);
  }
  int port_ = 0;
  std::unique_ptr<Gate> gate_;
};

TEST_F(GateTest, AConnectionArrivesWithItsFirstLinesAndItsPeer) {
  const int fd = client(port_);
  write_all(fd, "HELLO 1\nREADY 0\n");
  std::vector<Arrival> a = wait_for_arrivals(*gate_);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_THAT(a[0].lines, ElementsAre("HELLO 1", "READY 0"));
  EXPECT_THAT(a[0].from, StartsWith("127.0.0.1:"));
  EXPECT_TRUE(a[0].conn.open());
  a[0].conn.send("START");
  char buf[16] = {};
  EXPECT_EQ(::read(fd, buf, sizeof(buf)), 6);
  EXPECT_EQ(std::string(buf), "START\n");
  ::close(fd);
}

// A refused peer reads the whole answer and then the end, even when it goes on sending (closing a
// socket with unread bytes would reset the connection and could lose the answer).
TEST_F(GateTest, ARefusedPeerGetsItsAnswerAndTheEnd) {
  const int fd = client(port_);
  write_all(fd, "HELLO 1 1 2 1\n");
  std::vector<Arrival> a = wait_for_arrivals(*gate_);
  ASSERT_EQ(a.size(), 1u);
  gate_->refuse(std::move(a[0]), "ERROR not this job's");
  write_all(fd, "READY 1\n" + std::string(3000, 'x') + "\n");  // more, after the answer was sent
  std::thread gate_keeps_going([&] {
    for (int i = 0; i < 30; ++i) {
      std::vector<pollfd> fds;
      gate_->add_fds(fds);
      ::poll(fds.data(), fds.size(), 20);
      EXPECT_TRUE(gate_->arrivals().empty());
    }
  });
  EXPECT_EQ(read_to_end(fd), "ERROR not this job's\n");
  gate_keeps_going.join();
  ::close(fd);
}

// Silent peers and lines over kMaxLine never arrive: the gate closes them (the silent one after
// its silent limit); a peer that hangs up right after its line arrives.
TEST_F(GateTest, SilentAndOverlongPeersAreDropped) {
  const int silent = client(port_), longer = client(port_), brief = client(port_);
  write_all(longer, std::string(kMaxLine + 100, 'x'));
  write_all(brief, "HELLO 2\n");
  ::shutdown(brief, SHUT_WR);
  std::atomic<bool> done{false};
  std::vector<Arrival> arrived;
  std::thread gate_keeps_going([&] {
    while (!done) {
      std::vector<pollfd> fds;
      gate_->add_fds(fds);
      ::poll(fds.data(), fds.size(), 20);
      for (Arrival& a : gate_->arrivals()) arrived.push_back(std::move(a));
    }
  });
  EXPECT_EQ(read_to_end(longer), "") << "the overlong peer was not dropped";
  EXPECT_EQ(read_to_end(silent), "") << "the silent peer was not dropped";
  done = true;
  gate_keeps_going.join();
  ASSERT_EQ(arrived.size(), 1u);
  EXPECT_THAT(arrived[0].lines, ElementsAre("HELLO 2"));
  EXPECT_FALSE(arrived[0].conn.open());  // its end came with its line
  for (int fd : {silent, longer, brief}) ::close(fd);
}

}  // namespace
}  // namespace dtrain::comm::internal
