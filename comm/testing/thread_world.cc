#include "comm/testing/thread_world.h"

#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

namespace dtrain::comm {

Group& thread_world_rank(int rank, int world_size) {
  struct World {
    c10::intrusive_ptr<c10d::HashStore> store = c10::make_intrusive<c10d::HashStore>();
    std::vector<Group> groups;
    std::vector<std::once_flag> once;
    explicit World(int n) : groups(n), once(n) {}
  };
  static std::mutex mu;
  static std::unique_ptr<World> world;
  World* w;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!world) world = std::make_unique<World>(world_size);
    TORCH_CHECK(static_cast<int>(world->groups.size()) == world_size,
                "thread_world_rank: this process already has a ", world->groups.size(),
                "-rank world, asked for ", world_size);
    w = world.get();
  }
  TORCH_CHECK(rank >= 0 && rank < world_size, "thread_world_rank: rank ", rank, " outside [0, ",
              world_size, ")");
  std::call_once(w->once[rank], [w, rank, world_size] {
    InitOptions o;
    o.rank = rank;
    o.world_size = world_size;
    o.store = w->store;
    o.timeout = std::chrono::seconds(600);
    auto g = init_process_group(o);
    TORCH_CHECK(g.ok(), g.status().ToString());
    w->groups[rank] = *g;
  });
  return w->groups[rank];
}

}  // namespace dtrain::comm
