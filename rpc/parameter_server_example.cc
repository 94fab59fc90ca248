// A parameter server job with the RPC DistributedOptimizer: 2 parameter servers own the layers
// of a small MLP, 2 trainers fetch them, compute gradients on their own data, push them under a
// gradient context and step the owners' Adam optimizers. The trainers run concurrently; the
// owners serialise their steps.
//
//   ./bazelw run //rpc:parameter_server_example              # launches 4 local ranks
//   ./bazelw run //rpc:parameter_server_example -- --steps=300
//
// Ranks 0 and 1 are "ps0" and "ps1", ranks 2 and 3 "trainer0" and "trainer1" (torchrun-style
// RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT when set; otherwise it launches itself).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <torch/torch.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "launcher/local_launcher.h"
#include "rpc/agent.h"
#include "rpc/distributed_optimizer.h"
#include "rpc/remote.h"

// 64-bit, so that a value beyond an int gets the same one-line range error as any other.
ABSL_FLAG(int64_t, steps, 200, "Steps per trainer, 1 to 1000000.");
ABSL_FLAG(double, lr, 0.01, "Adam learning rate on the parameter servers, in (0, 10].");

namespace {

using namespace dtrain::rpc;  // NOLINT

constexpr int64_t kMaxSteps = 1'000'000;
constexpr double kMaxLr = 10;

[[noreturn]] void die(const std::string& message, int code = 1) {
  std::fprintf(stderr, "parameter_server_example: %s\n", message.c_str());
  std::exit(code);
}

// Bad flags end the program with one line and exit code 2, before any rank starts.
void check_flags() {
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  if (steps < 1 || steps > kMaxSteps) {
    die(absl::StrCat("--steps must be in [1, ", kMaxSteps, "], got ", steps), 2);
  }
  const double lr = absl::GetFlag(FLAGS_lr);
  if (!(lr > 0 && lr <= kMaxLr)) {  // NaN too
    die(absl::StrCat("--lr must be in (0, ", kMaxLr, "], got ", lr), 2);
  }
}

torch::Tensor seeded(std::vector<int64_t> shape, uint64_t seed, double scale) {
  auto gen = at::detail::createCPUGenerator(seed);
  return torch::randn(shape, gen) * scale;
}

int run() {
  const std::vector<std::string> names = {"ps0", "ps1", "trainer0", "trainer1"};
  int rank = -1;
  if (!absl::SimpleAtoi(std::getenv("RANK"), &rank) || rank < 0 ||
      rank >= static_cast<int>(names.size())) {
    die(std::string("RANK=") + std::getenv("RANK") +
        " is not a rank of this example: it needs RANK in 0..3 " +
        "(ps0, ps1, trainer0, trainer1) and WORLD_SIZE=4; run it without RANK to launch all four");
  }
  auto handlers = std::make_shared<Handlers>();
  ParameterOwner owner(handlers);
  // Each server owns one layer, created before the agent starts so the ids (1, 2) are there
  // before any trainer can ask.
  if (rank == 0) {
    owner.own("ps0", seeded({16, 64}, 1, 0.25));
    owner.own("ps0", torch::zeros({64}));
  } else if (rank == 1) {
    owner.own("ps1", seeded({64, 4}, 2, 0.125));
    owner.own("ps1", torch::zeros({4}));
  }
  AgentOptions o;
  o.name = names.at(rank);
  o.handlers = handlers;
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::create(o);
  if (!agent.ok()) die(std::string(agent.status().message()));
  if (rank >= 2) {
    const std::vector<RemoteRef> refs = {{"ps0", 1}, {"ps0", 2}, {"ps1", 1}, {"ps1", 2}};
    dtrain::optim::OptionsDict adam = dtrain::optim::new_options_dict();
    adam.insert("lr", absl::GetFlag(FLAGS_lr));
    auto opt = DistributedOptimizer::create(**agent, "Adam", adam, refs);
    if (!opt.ok()) die(std::string(opt.status().message()));
    const torch::Tensor teacher = seeded({16, 4}, 99, 0.5);
    const int steps =
        static_cast<int>(absl::GetFlag(FLAGS_steps));  // check_flags: at most kMaxSteps
    double first = NAN, last = NAN;
    for (int step = 1; step <= steps; ++step) {
      std::vector<torch::Tensor> params;
      for (const auto& r : refs) {
        absl::StatusOr<torch::Tensor> p = to_here(**agent, r);
        if (!p.ok()) die(std::string(p.status().message()));
        params.push_back(p->requires_grad_(true));
      }
      const torch::Tensor x = seeded({32, 16}, 1000 + step * 2 + rank, 1.0);
      const torch::Tensor y = torch::tanh(x.matmul(teacher));
      torch::Tensor loss = torch::mse_loss(
          torch::relu(x.matmul(params[0]) + params[1]).matmul(params[2]) + params[3], y);
      loss.backward();
      GradientContext ctx(**agent);
      std::vector<torch::Tensor> grads;
      for (auto& p : params) grads.push_back(p.grad());
      absl::Status s = ctx.send(refs, grads);
      if (s.ok()) s = (*opt)->step(ctx.id());
      if (s.ok()) s = ctx.release();
      if (!s.ok()) die(std::string(s.message()));
      last = loss.item<double>();
      if (step == 1) first = last;
      if (step % 20 == 0 || step == 1) std::printf("step %d loss %.5f\n", step, last);
    }
    std::printf("%s: loss %.5f at step 1 -> %.5f at step %d\n", names[rank].c_str(), first, last,
                steps);
    std::fflush(stdout);
  }
  absl::Status s = (*agent)->shutdown();  // servers wait here until the trainers are done
  if (!s.ok()) die(std::string(s.message()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  check_flags();
  if (std::getenv("RANK") == nullptr) {
    // TensorPipe logs a warning per closed connection at shutdown: keep the ranks' output readable.
    ::setenv("GLOG_minloglevel", "2", /*overwrite=*/0);
    dtrain::comm::LaunchOptions o;
    o.nproc_per_node = 4;
    std::vector<std::string> args = {"/proc/self/exe"};
    for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
    absl::StatusOr<int> code = dtrain::comm::launch_local(args, o);
    if (!code.ok()) die(std::string(code.status().message()));
    return *code;
  }
  if (std::getenv("WORLD_SIZE") == nullptr || std::string(std::getenv("WORLD_SIZE")) != "4") {
    die("this example needs WORLD_SIZE=4 (2 parameter servers + 2 trainers)");
  }
  return run();
}
