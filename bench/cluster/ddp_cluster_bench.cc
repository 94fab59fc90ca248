// One rank of the cluster benchmark (bench/cluster/run): DDP on //ddp_hooks/testing:benchmark_mlp's model
// (8 x Linear(1024, 1024), 32 MiB of float32 gradients) over Gloo across the hosts of a
// comm/testing/netns_cluster.py cluster, one rank per host, joined from torchrun's environment
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; GLOO_SOCKET_IFNAME=eth0 picks the shaped link).
// bench/cluster/ddp_cluster_peer.py is PyTorch's side, row for row.
//
//   ddp_cluster_bench [--modes=backward,allreduce,ddp,fp16,...] [--iters=10] [--batch=2]
//
// Rows (rank 0 prints one JSON object per line: mode, ms per iteration, cpu_ms -- CPU time per
// iteration of rank 0's process, all threads -- and tx_bytes per iteration sent by this host):
//   backward    zero_grad + forward + backward, no DDP (compute alone)
//   allreduce   all-reduces of the same gradient bytes in DDP's 25 MiB buckets, flattened once
//               (communication alone, as the peer times it)
//   ddp         DDP iteration with the default all-reduce hook, gradients as bucket views
//   fp16 bf16   DDP with the compression hooks
//   powersgd1 powersgd4   DDP with PowerSGD at rank 1 and 4 (compressing from iteration 2)
//   zero1       DDP + ZeroRedundancyOptimizer(Adam) step (ZeRO-1: 2(n-1)/n of the gradient bytes
//               reduced, then parameters broadcast)
//   zero2       the same with hook_with_zero2 (gradients reduce-scattered in backward, parameters
//               all-gathered in step)
//   localsgd_ddp, localsgd_periodic, localsgd_hierarchical
//               SGD regressing a fixed teacher network, every rank its own data, the model kept
//               in agreement by DDP at every step, by PostLocalSGDOptimizer with a
//               PeriodicModelAverager (all ranks every 2 steps), or with a HierarchicalModelAverager
//               (every 2 steps within a node of --ranks_per_node ranks, every 8 steps across all);
//               also prints "loss": rank 0's model on a fixed batch after the run's steps
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <absl/flags/flag.h>
#include <absl/flags/parse.h>
#include <absl/strings/str_format.h>
#include <absl/strings/str_split.h>
#include <torch/torch.h>

#include "bench/cluster/link_stats.h"
#include "comm/process_group.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "ddp_hooks/powersgd_hook.h"
#include "ddp_hooks/testing/benchmark_mlp.h"
#include "ddp_hooks/zero_hook.h"
#include "optim/functional/adapter.h"
#include "optim/model_averagers.h"
#include "optim/post_local_sgd_optimizer.h"
#include "optim/zero/zero_redundancy_optimizer.h"

ABSL_FLAG(std::string, modes, "backward,allreduce,ddp,fp16,bf16,powersgd1,powersgd4,zero1,zero2",
          "Rows to run, comma-separated (see the file's comment).");
ABSL_FLAG(int, iters, 10, "Timed iterations per row (after 3 untimed ones).");
ABSL_FLAG(int, batch, 2, "Samples per rank per iteration.");
ABSL_FLAG(int, ranks_per_node, 2, "Ranks per node, for localsgd_hierarchical's inner level.");

namespace dtrain::bench {
namespace {

using ddp_hooks::DistributedDataParallel;

struct Row {
  double ms = 0;
  int64_t tx = 0;
  double cpu_ms = 0;  // CPU time per iteration on rank 0's host: compute, copies, Gloo's threads
  double loss = -1;   // localsgd rows only
};

template <typename F>
Row timed(const comm::Group& g, int iters, F&& iteration) {
  for (int i = 0; i < 3; ++i) iteration();
  g->barrier()->wait();
  const int64_t tx0 = tx_bytes();
  const double cpu0 = cpu_ms();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) iteration();
  const double cpu = cpu_ms() - cpu0;
  g->barrier()->wait();  // every rank done: the slowest rank's time
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  Row r;
  r.ms = ms / iters;
  r.tx = (tx_bytes() - tx0) / iters;
  r.cpu_ms = cpu / iters;
  return r;
}

// The localsgd rows (see the top): ms per step, bytes, and the loss after 3 + iters steps.
Row run_local_sgd(const std::string& mode, const comm::Group& g, int iters, int batch) {
  torch::manual_seed(1);
  auto teacher = ddp_hooks::benchmark_mlp();
  torch::manual_seed(0);
  auto mlp = ddp_hooks::benchmark_mlp();
  auto data = [&](int64_t seed, int rows) {
    torch::manual_seed(seed);
    torch::Tensor x = torch::randn({rows, 1024});
    torch::NoGradGuard no_grad;
    return std::make_pair(x, teacher->forward(x) * 100);  // a target of order 1
  };
  auto loss_of = [&](const std::pair<torch::Tensor, torch::Tensor>& xy) {
    return torch::mse_loss(mlp->forward(xy.first) * 100, xy.second);
  };
  auto sgd = std::make_unique<torch::optim::SGD>(mlp->parameters(), torch::optim::SGDOptions(0.05));
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::unique_ptr<DistributedDataParallel> ddp;
  if (mode == "localsgd_ddp") {
    ddp_hooks::DDPOptions o;
    o.group = g;
    ddp = std::make_unique<DistributedDataParallel>(mlp.ptr(), o);
    opt = std::move(sgd);
  } else {
    std::shared_ptr<optim::ModelAverager> averager;
    if (mode == "localsgd_periodic") {
      averager = std::make_shared<optim::PeriodicModelAverager>(2, 0, g);
    } else {
      const int per_node = absl::GetFlag(FLAGS_ranks_per_node);
      averager = std::make_shared<optim::HierarchicalModelAverager>(
          std::vector<std::pair<int64_t, int>>{{2, per_node}, {8, g.size()}}, 0, g);
    }
    opt = std::make_unique<optim::PostLocalSGDOptimizer>(std::move(sgd), averager);
  }
  int64_t step = 0;
  Row r = timed(g, iters, [&] {
    const auto xy = data(1000 + 7919 * step++ + g.rank(), batch);
    opt->zero_grad();
    if (ddp) {
      ddp->forward([&] { return loss_of(xy); }).backward();
    } else {
      loss_of(xy).backward();
    }
    opt->step();
  });
  torch::NoGradGuard no_grad;
  r.loss = loss_of(data(424242, 64)).item<double>();
  return r;
}

std::unique_ptr<c10d::CommHookInterface> make_hook(const std::string& mode, const comm::Group& g) {
  if (mode == "fp16") return std::make_unique<ddp_hooks::CompressHook>(g, at::kHalf);
  if (mode == "bf16") return std::make_unique<ddp_hooks::CompressHook>(g, at::kBFloat16);
  auto state = std::make_shared<ddp_hooks::PowerSGDState>(g);
  state->matrix_approximation_rank = mode == "powersgd1" ? 1 : 4;
  state->start_powerSGD_iter = 2;
  return std::make_unique<ddp_hooks::PowerSGDHook>(state);
}

Row run_mode(const std::string& mode, const comm::Group& g, int iters, int batch) {
  if (mode.rfind("localsgd_", 0) == 0) return run_local_sgd(mode, g, iters, batch);
  torch::manual_seed(0);
  auto mlp = ddp_hooks::benchmark_mlp();
  const torch::Tensor x = torch::randn({batch, 1024}) * (g.rank() + 1);
  if (mode == "backward") {
    return timed(g, iters, [&] {
      mlp->zero_grad();
      mlp->forward(x).sum().backward();
    });
  }
  if (mode == "allreduce") {
    // DDP's buckets (25 MiB, last parameters first), flattened once, as the peer does: the row
    // times the all-reduces alone, not the copies into and out of buckets.
    std::vector<torch::Tensor> buckets, current;
    int64_t bytes = 0;
    const auto params = mlp->parameters();
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      current.push_back(torch::randn_like(*it).flatten());
      bytes += it->numel() * 4;
      if (bytes >= (25 << 20)) {
        buckets.push_back(torch::cat(current));
        current.clear();
        bytes = 0;
      }
    }
    if (!current.empty()) buckets.push_back(torch::cat(current));
    return timed(g, iters, [&] {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (auto& b : buckets) {
        std::vector<torch::Tensor> one = {b};
        works.push_back(g->allreduce(one));
      }
      for (auto& w : works) w->wait();
    });
  }
  const bool zero1 = mode == "zero1", zero2 = mode == "zero2";
  ddp_hooks::DDPOptions o;
  o.group = g;
  o.gradient_as_bucket_view = !zero2;
  DistributedDataParallel ddp(mlp.ptr(), o);
  if (!zero1 && !zero2) {
    if (mode != "ddp") ddp.register_comm_hook(make_hook(mode, g));
    return timed(g, iters, [&] {
      mlp->zero_grad();
      ddp.forward([&] { return mlp->forward(x).sum(); }).backward();
    });
  }
  optim::ZeroOptions zo;
  zo.group = g;
  zo.parameters_as_bucket_view = true;
  zo.shard_gradients = zero2;
  optim::ZeroRedundancyOptimizer zero(
      mlp->parameters(),
      optim::local_optimizer<optim::FunctionalOptimizerAdapter>("Adam", {{"lr", 1e-4}}), zo);
  if (zero2) ddp.register_comm_hook(ddp_hooks::hook_with_zero2(ddp, zero));
  return timed(g, iters, [&] {
    zero.zero_grad();
    ddp.forward([&] { return mlp->forward(x).sum(); }).backward();
    zero.step();
  });
}

int main_impl(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);  // one core per host, as the cluster runs every host on this machine
  comm::InitOptions init;
  init.timeout = std::chrono::seconds(300);
  absl::StatusOr<comm::Group> g = comm::init_process_group(init);
  if (!g.ok()) {
    std::fprintf(stderr, "ddp_cluster_bench: %s\n", std::string(g.status().message()).c_str());
    return 1;
  }
  const std::vector<std::string> modes =
      absl::StrSplit(absl::GetFlag(FLAGS_modes), ',', absl::SkipEmpty());
  for (const std::string& mode : modes) {
    const Row r = run_mode(mode, *g, absl::GetFlag(FLAGS_iters), absl::GetFlag(FLAGS_batch));
    if (g->rank() == 0) {
      std::printf(
          "{\"impl\": \"dtrain\", \"mode\": \"%s\", \"world\": %d, \"ms\": %.2f, \"cpu_ms\": %.2f, "
          "\"tx_bytes\": %lld%s}\n",
          mode.c_str(), g->size(), r.ms, r.cpu_ms, static_cast<long long>(r.tx),
          r.loss < 0 ? "" : absl::StrFormat(", \"loss\": %.6g", r.loss).c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace dtrain::bench

int main(int argc, char** argv) { return dtrain::bench::main_impl(argc, argv); }
