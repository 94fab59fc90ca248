// Test support: RPC workers as threads of one process, each with its own TensorPipe agent, over
// a shared in-process store.
//
//   dtrain::rpc::testing::run_workers({"trainer", "ps1"}, [](dtrain::rpc::testing::Worker& w) {
//     if (w.rank == 0) { ... w.agent ... w.owner ... }
//   });
#ifndef DTRAIN_RPC_TESTING_TEST_WORKERS_H_
#define DTRAIN_RPC_TESTING_TEST_WORKERS_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "rpc/agent.h"
#include "rpc/remote.h"

namespace dtrain::rpc::testing {

struct Worker {
  int rank;
  Agent& agent;
  ParameterOwner& owner;
};

// Runs one thread per name, each with its own agent, a ParameterOwner and `extra` handlers; fn
// runs between creation and the collective shutdown.
inline void run_workers(
    const std::vector<std::string>& names, const std::function<void(Worker&)>& fn,
    std::chrono::milliseconds timeout = std::chrono::seconds(30),
    const std::function<void(int, Handlers&)>& extra = nullptr,
    c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>()) {
  std::vector<std::thread> threads;
  for (int rank = 0; rank < static_cast<int>(names.size()); ++rank) {
    threads.emplace_back([&, rank] {
      auto handlers = std::make_shared<Handlers>();
      ParameterOwner owner(handlers);
      if (extra) extra(rank, *handlers);
      AgentOptions o;
      o.name = names[rank];
      o.rank = rank;
      o.world_size = static_cast<int>(names.size());
      o.store = store;
      o.handlers = handlers;
      o.timeout = timeout;
      o.num_worker_threads = 4;
      absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::create(o);
      ASSERT_TRUE(agent.ok()) << agent.status();
      Worker w{rank, **agent, owner};
      fn(w);
      absl::Status s = (*agent)->shutdown();
      EXPECT_TRUE(s.ok()) << s;
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace dtrain::rpc::testing

#endif  // DTRAIN_RPC_TESTING_TEST_WORKERS_H_
