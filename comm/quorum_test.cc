#include "comm/quorum.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/status/status.h"

namespace dtrain::comm {
namespace {

using std::chrono::milliseconds;

QuorumOptions options_for(const Lighthouse& lighthouse, int64_t id) {
  QuorumOptions o;
  o.lighthouse_port = lighthouse.port();
  o.replica_id = id;
  o.min_replicas = 2;
  o.expected_replicas = 3;
  o.join_timeout = milliseconds(300);
  o.quorum_timeout = std::chrono::seconds(60);
  o.timeout = std::chrono::seconds(60);
  return o;
}

std::unique_ptr<QuorumClient> connected(const QuorumOptions& o) {
  absl::StatusOr<std::unique_ptr<QuorumClient>> c = QuorumClient::connect(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// The sum of every member's (replica_id + 1) over the quorum's group.
double group_sum(const Quorum& q) {
  std::vector<at::Tensor> t = {at::full({1}, q.members[q.rank].replica_id + 1.0)};
  q.group->allreduce(t)->wait();
  return t[0].item<double>();
}

// Waits (on the lighthouse's store) until someone registered for quorum id q.
void wait_registered(int port, int64_t q) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = false;
  so.useLibUV = false;
  c10d::TCPStore store("127.0.0.1", so);
  store.wait({"quorum/" + std::to_string(q) + "/slot/1"}, std::chrono::seconds(60));
}

// Three replicas: quorum 1 of all (expected_replicas), 2 of all (every member of 1 came), 3
// without replica 2 (it is late: dropped after join_timeout), and 4 where replica 2, which
// registered for 3 too late and moved to 4, is behind and heals from the lowest participant.
TEST(QuorumTest, DropsALateReplicaAndReadmitsItBehind) {
  Lighthouse lighthouse;
  std::vector<std::unique_ptr<QuorumClient>> clients;
  for (int id = 0; id < 3; ++id) clients.push_back(connected(options_for(lighthouse, id)));
  ASSERT_TRUE(clients[0] && clients[1] && clients[2]);
  std::atomic<bool> third_done{false};
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int id = 0; id < 3; ++id) {
    threads.emplace_back([&, id] {
      QuorumClient& c = *clients[id];
      absl::StatusOr<Quorum> q1 = c.quorum(0, false);
      if (!q1.ok()) return void(errors[id] = q1.status().ToString());
      EXPECT_EQ(q1->quorum_id, 1);
      EXPECT_EQ(q1->replica_ids(), (std::vector<int64_t>{0, 1, 2}));
      EXPECT_EQ(q1->rank, id);
      EXPECT_TRUE(q1->participants().empty());
      EXPECT_FALSE(q1->any_healing());
      EXPECT_EQ(group_sum(*q1), 6.0);
      absl::StatusOr<Quorum> q2 = c.quorum(0, true);
      if (!q2.ok()) return void(errors[id] = q2.status().ToString());
      EXPECT_EQ(q2->quorum_id, 2);
      EXPECT_EQ(q2->participants(), (std::vector<int>{0, 1, 2}));
      EXPECT_EQ(group_sum(*q2), 6.0);
      if (id < 2) {
        absl::StatusOr<Quorum> q3 = c.quorum(1, true);
        if (!q3.ok()) return void(errors[id] = q3.status().ToString());
        EXPECT_EQ(q3->quorum_id, 3);
        EXPECT_EQ(q3->replica_ids(), (std::vector<int64_t>{0, 1}));
        EXPECT_EQ(group_sum(*q3), 3.0);
        if (id == 0) {
          third_done = true;
          wait_registered(lighthouse.port(), 4);  // replica 2 came late to 3 and moved to 4
        }
        while (id == 1 && !third_done) std::this_thread::sleep_for(milliseconds(5));
        if (id == 1) wait_registered(lighthouse.port(), 4);
        absl::StatusOr<Quorum> q4 = c.quorum(2, true);
        if (!q4.ok()) return void(errors[id] = q4.status().ToString());
        EXPECT_EQ(q4->quorum_id, 4);
        EXPECT_EQ(q4->replica_ids(), (std::vector<int64_t>{0, 1, 2}));
        EXPECT_EQ(q4->max_step, 2);
        EXPECT_EQ(q4->participants(), (std::vector<int>{0, 1}));
        EXPECT_TRUE(q4->healing(2));
        EXPECT_FALSE(q4->healing(0));
        EXPECT_EQ(q4->recover_src(), 0);
        EXPECT_EQ(group_sum(*q4), 6.0);
      } else {
        while (!third_done) std::this_thread::sleep_for(milliseconds(5));
        absl::StatusOr<Quorum> q4 = c.quorum(1, true);  // registers for 3: decided; then 4
        if (!q4.ok()) return void(errors[id] = q4.status().ToString());
        EXPECT_EQ(q4->quorum_id, 4);
        EXPECT_EQ(q4->rank, 2);
        EXPECT_TRUE(q4->healing(q4->rank));
        EXPECT_EQ(group_sum(*q4), 6.0);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int id = 0; id < 3; ++id) EXPECT_EQ(errors[id], "") << "replica " << id;
}

// A member that registered and died before its group formed: the others' quorum() is Aborted
// after `timeout`, and the next quorum drops it after join_timeout. (Its registration is written
// here as a replica would write it, so that nobody behind it makes the group.)
TEST(QuorumTest, AMemberLostBeforeItsGroupFormedIsDroppedNext) {
  Lighthouse lighthouse;
  std::vector<std::unique_ptr<QuorumClient>> clients;
  for (int id = 0; id < 3; ++id) {
    QuorumOptions o = options_for(lighthouse, id);
    o.timeout = std::chrono::seconds(1);
    clients.push_back(connected(o));
  }
  ASSERT_TRUE(clients[0] && clients[1] && clients[2]);
  std::vector<std::string> errors(3);
  auto run = [&](int n, const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int id = 0; id < n; ++id) threads.emplace_back(fn, id);
    for (std::thread& t : threads) t.join();
  };
  run(3, [&](int id) {
    absl::StatusOr<Quorum> q = clients[id]->quorum(0, false);
    if (!q.ok()) errors[id] = q.status().ToString();
  });
  {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(lighthouse.port());
    so.isServer = false;
    so.useLibUV = false;
    c10d::TCPStore store("127.0.0.1", so);
    const int64_t slot = store.add("quorum/2/n", 1);
    const std::string me = "2,0,1,0";
    store.set("quorum/2/slot/" + std::to_string(slot), std::vector<uint8_t>(me.begin(), me.end()));
  }
  run(2, [&](int id) {
    absl::StatusOr<Quorum> q = clients[id]->quorum(0, true);
    EXPECT_EQ(q.status().code(), absl::StatusCode::kAborted) << q.status();
    EXPECT_NE(q.status().message().find("did not form"), std::string::npos) << q.status();
    q = clients[id]->quorum(0, true);
    if (!q.ok()) return void(errors[id] = q.status().ToString());
    EXPECT_EQ(q->quorum_id, 3);
    EXPECT_EQ(q->replica_ids(), (std::vector<int64_t>{0, 1}));
    EXPECT_EQ(q->participants(), (std::vector<int>{0, 1}));
    EXPECT_EQ(group_sum(*q), 3.0);
  });
  for (int id = 0; id < 3; ++id) EXPECT_EQ(errors[id], "") << "replica " << id;
}

// A new process alone never starts a quorum of a running job: it would commit rounds from its
// stale state; it fails after quorum_timeout, saying so.
TEST(QuorumTest, ALoneNewProcessDoesNotStartARunningJobsQuorum) {
  Lighthouse lighthouse;
  QuorumOptions o = options_for(lighthouse, 0);
  o.min_replicas = 1;
  o.expected_replicas = 1;
  std::unique_ptr<QuorumClient> first = connected(o);
  ASSERT_TRUE(first);
  absl::StatusOr<Quorum> q1 = first->quorum(0, false);
  ASSERT_TRUE(q1.ok()) << q1.status();
  EXPECT_EQ(q1->replica_ids(), (std::vector<int64_t>{0}));
  o.replica_id = 1;
  o.join_timeout = milliseconds(20);
  o.quorum_timeout = milliseconds(400);
  std::unique_ptr<QuorumClient> late = connected(o);
  ASSERT_TRUE(late);
  absl::StatusOr<Quorum> q = late->quorum(0, false);
  ASSERT_FALSE(q.ok());
  EXPECT_EQ(q.status().code(), absl::StatusCode::kDeadlineExceeded) << q.status();
  EXPECT_NE(q.status().message().find("new process"), std::string::npos) << q.status();
  EXPECT_NE(q.status().message().find("quorum id 2"), std::string::npos) << q.status();
}

TEST(QuorumTest, RefusesBadOptions) {
  Lighthouse lighthouse;
  QuorumOptions o = options_for(lighthouse, -1);
  absl::StatusOr<std::unique_ptr<QuorumClient>> c = QuorumClient::connect(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("replica_id"), std::string::npos) << c.status();
  o = options_for(lighthouse, 0);
  o.quorum_timeout = o.join_timeout;
  c = QuorumClient::connect(o);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("join_timeout < quorum_timeout"), std::string::npos)
      << c.status();
}

}  // namespace
}  // namespace dtrain::comm
