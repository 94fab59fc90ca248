// torch.distributed.optim's DistributedOptimizer example, as written there, in C++:
//
//   with dist_autograd.context() as context_id:
//       rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
//       rref2 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
//       loss = rref1.to_here() + rref2.to_here()
//       dist_autograd.backward(context_id, [loss.sum()])
//       dist_optim = DistributedOptimizer(optim.SGD, [rref1, rref2], lr=0.05)
//       dist_optim.step(context_id)
//
//   ./bazelw run //rpc:seed_example          # launches worker0 and worker1 on this machine
//
// worker0 runs the example; worker1 owns the two values and prints them after the step
// (4 - 0.05 = 3.95 and 2 - 0.05 = 1.95). RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as torchrun
// sets them when present; otherwise it launches itself.
#include <cstdio>
#include <cstdlib>
#include <string>

#include <torch/optim/sgd.h>
#include <torch/torch.h>

#include "absl/strings/numbers.h"
#include "launcher/local_launcher.h"
#include "rpc/agent.h"
#include "rpc/dist_autograd.h"
#include "rpc/distributed_optimizer.h"
#include "rpc/remote.h"

namespace {

using namespace dtrain::rpc;  // NOLINT

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "seed_example: %s\n", message.c_str());
  std::exit(1);
}

template <typename T>
T check(absl::StatusOr<T> v) {
  if (!v.ok()) die(std::string(v.status().message()));
  return *std::move(v);
}

void check(const absl::Status& s) {
  if (!s.ok()) die(std::string(s.message()));
}

std::string values(const torch::Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.numel(); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%s%.4f", i ? ", " : "", t[i].item<double>());
    out += buf;
  }
  return out + "]";
}

int run(int rank) {
  auto handlers = std::make_shared<Handlers>();
  ParameterOwner owner(handlers);  // every worker can own values (rpc.remote's results)
  AgentOptions o;
  o.name = rank == 0 ? "worker0" : "worker1";
  o.handlers = handlers;
  std::unique_ptr<Agent> agent = check(Agent::create(o));
  RemoteRef rref1, rref2;
  if (rank == 0) {
    dist_autograd::Context context(*agent);  // with dist_autograd.context() as context_id:
    // Forward pass.
    rref1 = check(remote(*agent, "worker1", "torch.add", {torch::ones({2}), 3}));
    rref2 = check(remote(*agent, "worker1", "torch.add", {torch::ones({2}), 1}));
    torch::Tensor loss = check(dist_autograd::to_here(context, rref1)) +
                         check(dist_autograd::to_here(context, rref2));
    // Backward pass.
    check(dist_autograd::backward(context, {loss.sum()}));
    // Optimizer.
    std::unique_ptr<DistributedOptimizer> dist_optim =
        check(DistributedOptimizer::create<torch::optim::SGD>(
            *agent, torch::optim::SGDOptions(0.05), {rref1, rref2}));
    check(dist_optim->step(context.id()));
    std::printf("worker0: rref1.to_here() = %s, rref2.to_here() = %s after the step\n",
                values(check(to_here(*agent, rref1))).c_str(),
                values(check(to_here(*agent, rref2))).c_str());
    std::fflush(stdout);
  }
  check(agent->shutdown());  // worker1 waits here until worker0 is done
  if (rank == 1) {
    // The values rpc.remote created here, in creation order (ids 1 and 2).
    std::printf("worker1: rref1 = %s, rref2 = %s\n", values(owner.local(1)).c_str(),
                values(owner.local(2)).c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const char* rank_env = std::getenv("RANK");
  if (rank_env == nullptr) {
    ::setenv("GLOG_minloglevel", "2",
             /*overwrite=*/0);  // TensorPipe's per-connection shutdown warnings
    dtrain::comm::LaunchOptions o;
    o.nproc_per_node = 2;
    std::vector<std::string> args = {"/proc/self/exe"};
    for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
    return check(dtrain::comm::launch_local(args, o));
  }
  int rank = -1;
  const char* world = std::getenv("WORLD_SIZE");
  if (!absl::SimpleAtoi(rank_env, &rank) || rank < 0 || rank > 1 || world == nullptr ||
      std::string(world) != "2") {
    die(std::string("RANK=") + rank_env + " WORLD_SIZE=" + (world ? world : "(unset)") +
        " is not a rank of this example: it needs RANK 0 (worker0) or 1 (worker1) and "
        "WORLD_SIZE=2; run it "
        "without RANK to launch both");
  }
  return run(rank);
}
