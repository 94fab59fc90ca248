#include "comm/heartbeat.h"

#include <algorithm>
#include <atomic>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/libtorch_compat.h"
#include "comm/rendezvous_checks.h"

namespace dtrain::comm {

struct Heartbeat::Shared {
  c10::intrusive_ptr<c10d::Store> beat_store;  // the beating thread's own client
  c10::intrusive_ptr<c10d::Store> root;        // for reads, from callers' threads (cloned per call)
  int rank = 0;
  int world_size = 1;
  std::chrono::milliseconds period{2000};
  std::atomic<bool> stop{false};
};

namespace {

std::string key(int rank) { return absl::StrCat("dtrain/heartbeat/", rank); }

// A second client of the same TCP store (c10d's TCPStore client is not thread-safe); other stores
// (in-process HashStore, FileStore) are used as they are.
c10::intrusive_ptr<c10d::Store> own_client(const c10::intrusive_ptr<c10d::Store>& store,
                                           std::chrono::milliseconds timeout) {
  auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get());
  if (tcp == nullptr) return store;
  c10d::TCPStoreOptions o = tcp_store_options();
  o.port = tcp->getPort();
  o.isServer = false;
  o.waitWorkers = false;
  o.timeout = std::max<std::chrono::milliseconds>(
      timeout, std::chrono::seconds(30));  // callers bound their waits
  return c10::make_intrusive<c10d::TCPStore>(tcp->getHost(), o);
}

}  // namespace

Heartbeat::Heartbeat(const Group& world, std::chrono::milliseconds period)
    : shared_(std::make_shared<Shared>()) {
  shared_->root = world.root_store();
  shared_->rank = world.rank();
  shared_->world_size = world.size();
  shared_->period = period;
  shared_->beat_store = own_client(shared_->root, 3 * period);
  std::thread([s = shared_] {
    while (!s->stop.load()) {
      try {
        s->beat_store->add(key(s->rank), 1);
      } catch (const std::exception&) {
        return;  // the store is gone: the job is ending, and readers will say so
      }
      std::this_thread::sleep_for(s->period);
    }
  }).detach();
}

Heartbeat::~Heartbeat() { shared_->stop = true; }

absl::StatusOr<std::vector<int>> Heartbeat::stalled_ranks() const {
  const std::shared_ptr<Shared> s = shared_;
  return run_with_deadline<std::vector<int>>(
      [s]() -> absl::StatusOr<std::vector<int>> {
        c10::intrusive_ptr<c10d::Store> store = own_client(s->root, 3 * s->period);
        auto read = [&] {
          std::vector<int64_t> v(s->world_size);
          for (int r = 0; r < s->world_size; ++r) v[r] = store->add(key(r), 0);
          return v;
        };
        const std::vector<int64_t> before = read();
        std::this_thread::sleep_for(3 * s->period);
        const std::vector<int64_t> after = read();
        std::vector<int> stalled;
        for (int r = 0; r < s->world_size; ++r) {
          if (r != s->rank && after[r] == before[r]) stalled.push_back(r);
        }
        return stalled;
      },
      std::chrono::steady_clock::now() + 6 * shared_->period, "reading the heartbeats");
}

std::string Heartbeat::describe_stalls() const {
  absl::StatusOr<std::vector<int>> stalled = stalled_ranks();
  if (!stalled.ok()) {
    return absl::StrCat(
        "the rendezvous store (run by rank 0) does not answer, so rank 0 is stopped or gone, or "
        "the network is down (",
        stalled.status().message(), ")");
  }
  if (stalled->empty()) return "every rank is alive (heartbeats continue)";
  return absl::StrCat(stalled->size() == 1 ? "rank " : "ranks ", absl::StrJoin(*stalled, ", "),
                      " stopped responding (no heartbeat for ",
                      std::chrono::duration_cast<std::chrono::seconds>(3 * shared_->period).count(),
                      " s): look at ", stalled->size() == 1 ? "that rank" : "those ranks",
                      " first");
}

}  // namespace dtrain::comm
