// DDP over bfloat16 parameters with ZeRO's local AdamW keeping param_remainders (an int16
// remainder per element: with the bfloat16 parameter, an exact float32 master;
// optim/functional/adam.h), through the DDP engine's ZeRO paths (zero_hook.h): the overlap hook
// (both schedules, whole and sliced buckets) and ZeRO-2 (hook_with_zero2, the gradients
// reduce-scattered in bfloat16). Every step is, bit for bit, one unsharded AdamW with
// param_remainders stepped with the averaged gradients the ranks reduced; those gradients are the
// whole batch's (up to bfloat16 rounding) and the same on every rank. Ranks as threads, world
// sizes 1 to 3, Gloo (Debian sid's LibTorch 2.14 has no bfloat16 Gloo collectives).
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/object_collectives.h"
#include "comm/testing/test_harness.h"
#include "ddp_hooks/default_hooks.h"
#include "ddp_hooks/testing/fill_sin.h"
#include "ddp_hooks/testing/three_layer_mlp.h"
#include "ddp_hooks/zero_hook.h"
#include "optim/functional/state_precision.h"
#include "optim/zero/grad_shards.h"

namespace dtrain::ddp_hooks {
namespace {

using comm::testing::run_ranks_as_threads;
using optim::FunctionalOptimizerAdapter;
using optim::ZeroOptions;
using optim::ZeroRedundancyOptimizer;

constexpr int kSteps = 4;
constexpr int kBatch = 12;  // divisible by 1, 2 and 3

// Parameters of 300, 30, 600, 20, 60 and 3 elements: 8-bit state in whole and partial blocks.
struct NetImpl : ThreeLayerMlpImpl {
  NetImpl() : ThreeLayerMlpImpl(/*in=*/10, /*h1=*/30, /*h2=*/20, /*out=*/3) {}
};
TORCH_MODULE(Net);

Net make_net() {
  Net net;
  fill_sin(*net, 0.3);
  net->to(at::kBFloat16);
  return net;
}

optim::OptionsDict adamw_options(const char* state_dtype) {
  optim::OptionsDict o = optim::new_options_dict();
  o.insert("lr", 0.01);
  o.insert("weight_decay", 0.1);
  o.insert(optim::kParamRemaindersKey, true);
  if (state_dtype != nullptr) o.insert(optim::kStateDtypeKey, std::string(state_dtype));
  // Rounded to nearest: stochastic rounding is keyed by the index in the local optimizer.
  o.insert(optim::kStateStochasticRoundingKey, false);
  return o;
}
std::string dtype_name(const char* state_dtype) {
  return state_dtype == nullptr ? "float32 state" : std::string(state_dtype) + " state";
}

DDPOptions ddp_options(const comm::Group& g) {
  DDPOptions d;
  d.group = g;
  d.bucket_cap_mb = 1e-3;  // several buckets: the hooks step and send more than once per backward
  d.first_bucket_cap_mb = 1e-3;
  return d;
}

at::Tensor batch_x(int s) {
  return at::cos(at::arange(kBatch * 10, at::kFloat).view({kBatch, 10}) * 0.7 + s)
      .to(at::kBFloat16);
}
at::Tensor batch_y(int s) {
  return at::sin(at::arange(kBatch * 3, at::kFloat).view({kBatch, 3}) + s).to(at::kBFloat16);
}
at::Tensor rows(const at::Tensor& t, const comm::Group& g) {
  const int64_t m = kBatch / g.size();
  return t.narrow(0, m * g.rank(), m);
}

// This rank's rows of step s, forward and backward through DDP.
void backward(Net& net, DistributedDataParallel& ddp, const comm::Group& g, int s) {
  ddp.forward(
         [&] { return torch::mse_loss(net->forward(rows(batch_x(s), g)), rows(batch_y(s), g)); })
      .backward();
}

// One process: the same bfloat16 model and AdamW with param_remainders, unsharded.
struct Reference {
  explicit Reference(const char* state_dtype)
      : net(make_net()), opt(net->parameters(), "AdamW", adamw_options(state_dtype)) {}

  // Checks `averaged` (the ranks' reduced gradients of step s) against the whole batch's, then
  // steps with `averaged`.
  void step(int s, const std::vector<at::Tensor>& averaged, const std::string& what) {
    auto params = net->parameters();
    ASSERT_EQ(params.size(), averaged.size());
    opt.zero_grad();
    torch::mse_loss(net->forward(batch_x(s)), batch_y(s)).backward();
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(averaged[i].defined()) << what << ": no gradient for param " << i;
      ASSERT_EQ(averaged[i].scalar_type(), at::kBFloat16) << what << ": param " << i;
      const at::Tensor whole = params[i].grad().to(at::kFloat);
      const double scale = whole.abs().max().item<double>();
      const double diff = (averaged[i].to(at::kFloat) - whole).abs().max().item<double>();
      // bfloat16 everywhere: forward, backward and (where Gloo has them, LibTorch 2.6) bfloat16
      // sums of the ranks' shares; a rank's share missing is off by a third of the scale or more.
      EXPECT_LE(diff, 0.05 * scale + 1e-4) << what << ": param " << i << " gradient";
      params[i].mutable_grad() = averaged[i].detach().clone();
    }
    opt.step();
  }

  Net net;
  FunctionalOptimizerAdapter opt;
};

// (SCOPED_TRACE does not reach the rank threads: `what` names the case.)
void expect_bits_equal(Net& got, Net& want, const std::string& what) {
  auto a = got->parameters(), b = want->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].scalar_type(), at::kBFloat16) << what << ": param " << i;
    EXPECT_TRUE(at::equal(a[i].view(at::kShort), b[i].view(at::kShort)))
        << what << ": param " << i << " max diff "
        << (a[i].to(at::kFloat) - b[i].to(at::kFloat)).abs().max().item<float>();
  }
}

// Rank 0's parameters are every rank's, bit for bit.
void expect_ranks_agree(const comm::Group& g, Net& net, const std::string& what) {
  for (const at::Tensor& p : net->parameters()) {
    c10::IValue mine = p.detach().view(at::kShort).clone();
    ASSERT_TRUE(comm::broadcast_object(g, mine, 0).ok());
    EXPECT_TRUE(mine.toTensor().equal(p.detach().view(at::kShort)))
        << what << ": rank " << g.rank() << " differs from rank 0";
  }
}

std::vector<at::Tensor> grads_of(Net& net) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : net->parameters()) out.push_back(p.grad());
  return out;
}

// The overlap hook steps during backward with the all-reduced bucket, which DDP then writes into
// .grad: the reference steps with those gradients.
TEST(ZeroHookParamRemaindersTest, OverlapHookStepsAsOneAdamWOnTheAveragedGradients) {
  const std::vector<std::pair<ZeroStepSchedule, bool>> schedules = {
      {ZeroStepSchedule::kAfterBackward, false},
      {ZeroStepSchedule::kInterleaved, false},
      {ZeroStepSchedule::kAfterBackward, true},
  };
  for (int world : {1, 2, 3}) {
    for (const char* state_dtype : {static_cast<const char*>(nullptr), optim::kState8Bit}) {
      for (const auto& [schedule, shard_buckets] : schedules) {
        const std::string what =
            "world " + std::to_string(world) + " " + dtype_name(state_dtype) +
            (schedule == ZeroStepSchedule::kInterleaved ? " interleaved" : " after backward") +
            (shard_buckets ? " bucket slices" : "");
        run_ranks_as_threads(world, [&](comm::Group& g) {
          Net net = make_net();
          DistributedDataParallel ddp(net.ptr(), ddp_options(g));
          ZeroOptions zo;
          zo.group = g;
          zo.overlap_with_ddp = true;
          ZeroRedundancyOptimizer zero(net->parameters(),
                                       optim::local_optimizer<FunctionalOptimizerAdapter>(
                                           "AdamW", adamw_options(state_dtype)),
                                       zo);
          ddp.register_comm_hook(std::make_unique<ZeroOverlapHook>(
              std::make_unique<AllReduceHook>(g), ddp, zero, shard_buckets, schedule));
          Reference reference(state_dtype);
          for (int s = 0; s < kSteps; ++s) {
            const std::string at_step = what + " step " + std::to_string(s);
            zero.zero_grad();
            backward(net, ddp, g, s);  // the hook stepped every parameter
            reference.step(s, grads_of(net), at_step);
            expect_bits_equal(net, reference.net, at_step);
          }
          expect_ranks_agree(g, net, what);
        });
      }
    }
  }
}

// The whole averaged gradient of ZeRO-2's step: every rank's reduced chunk of every bucket,
// gathered (as bytes) and cut into the bucket's parameters.
std::vector<at::Tensor> gathered_grads(const comm::Group& g, const DistributedDataParallel& ddp,
                                       ZeroRedundancyOptimizer& zero) {
  optim::ZeroGradShards shards(zero);
  const auto& params = ddp.parameters();
  std::vector<at::Tensor> out(params.size());
  const auto buckets = ddp.bucket_indices();
  for (size_t b = 0; b < buckets.size(); ++b) {
    const at::Tensor chunk = shards.grad_chunk(b);
    std::vector<at::Tensor> mine = {chunk.view(at::kByte).clone()};
    std::vector<std::vector<at::Tensor>> all(1);
    for (int r = 0; r < g.size(); ++r) all[0].push_back(at::empty_like(mine[0]));
    g->allgather(all, mine)->wait();
    const at::Tensor bucket = at::cat(all[0]).view(at::kBFloat16);
    EXPECT_EQ(bucket.numel(), shards.padded_numel(b)) << "bucket " << b;
    int64_t offset = 0;
    for (size_t d : buckets[b]) {
      out[d] = bucket.narrow(0, offset, params[d].numel()).view(params[d].sizes()).clone();
      offset += params[d].numel();
    }
    EXPECT_EQ(offset, shards.bucket_numel(b)) << "bucket " << b;
  }
  return out;
}

// ZeRO-2: each rank steps only its chunks of the bfloat16 buckets with its reduced gradient
// slices, then the chunks are all-gathered. (8-bit state is left out: its blocks follow the
// chunks, not the parameters, so it is not the unsharded optimizer's bit for bit.)
TEST(ZeroHookParamRemaindersTest, Zero2StepsAsOneAdamWOnTheAveragedGradients) {
  for (int world : {1, 2, 3}) {
    for (const char* state_dtype : {static_cast<const char*>(nullptr), optim::kStateBFloat16}) {
      const std::string what =
          "ZeRO-2 world " + std::to_string(world) + " " + dtype_name(state_dtype);
      run_ranks_as_threads(world, [&](comm::Group& g) {
        Net net = make_net();
        DistributedDataParallel ddp(net.ptr(), ddp_options(g));
        ZeroOptions zo;
        zo.group = g;
        zo.shard_gradients = true;
        ZeroRedundancyOptimizer zero(
            net->parameters(),
            optim::local_optimizer<FunctionalOptimizerAdapter>("AdamW", adamw_options(state_dtype)),
            zo);
        ddp.register_comm_hook(hook_with_zero2(ddp, zero));
        Reference reference(state_dtype);
        for (int s = 0; s < kSteps; ++s) {
          const std::string at_step = what + " step " + std::to_string(s);
          zero.zero_grad();
          backward(net, ddp, g, s);
          zero.step();
          reference.step(s, gathered_grads(g, ddp, zero), at_step);
          expect_bits_equal(net, reference.net, at_step);
        }
        expect_ranks_agree(g, net, what);
      });
    }
  }
}

}  // namespace
}  // namespace dtrain::ddp_hooks
