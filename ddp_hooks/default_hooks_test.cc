#include "ddp_hooks/default_hooks.h"

#include <future>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"
#include "ddp_hooks/libtorch_compat.h"
#include "ddp_hooks/powersgd_hook.h"

namespace dtrain::ddp_hooks {
namespace {

using comm::testing::run_ranks_as_threads;

// One bucket of a 6x4 matrix and a 3-vector (last bucket of the iteration).
struct OneBucket {
  at::Tensor buffer;
  std::vector<at::Tensor> params = {at::zeros({6, 4}), at::zeros({3})};
  std::vector<c10::IntArrayRef> sizes;
  explicit OneBucket(const at::Tensor& values) : buffer(values.clone()) {
    for (const auto& p : params) sizes.push_back(p.sizes());
  }
  at::Tensor run(c10d::CommHookInterface& hook) {
    c10d::GradBucket b = make_grad_bucket(0, 1, buffer, {0, 24}, {24, 3}, sizes, params);
    auto fut = hook.runHook(b);
    fut->wait();
    at::Tensor result = hook.parseHookResult(fut->value());
    if (!result.is_same(buffer)) buffer.copy_(result);  // what DDP does with a hook's result
    return buffer;
  }
};

at::Tensor values_for(int rank) { return at::sin(at::arange(27, at::kFloat) * 0.37 + rank); }

TEST(DefaultHooksTest, CompressHooks) {
  // fp16 all-reduces in fp16; bf16 too on LibTorch 2.x, while 1.13's Gloo (which cannot reduce
  // bf16) gathers bf16 and sums in fp32.
  run_ranks_as_threads(2, [](comm::Group& g) {
    for (at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
      CompressHook hook(g, dtype);
      OneBucket b(values_for(g.rank()));
      at::Tensor out = b.run(hook);
      const at::Tensor want = (values_for(0) + values_for(1)) / 2;
      EXPECT_EQ(out.scalar_type(), at::kFloat);
      EXPECT_TRUE(out.allclose(want, 0, dtype == at::kHalf ? 2e-3 : 2e-2)) << dtype;
      EXPECT_FALSE(out.equal(want)) << "values went through " << dtype;
      if (dtype == at::kBFloat16) {
        // Bit for bit: Gloo sums the bf16 halves in bf16, as PyTorch's bf16 hook does; where this
        // Gloo cannot reduce bf16 (Debian sid's), dtrain sums the gathered halves in fp32.
        const at::Tensor h0 = values_for(0).to(dtype).div_(2), h1 = values_for(1).to(dtype).div_(2);
        const at::Tensor exact =
            gloo_reduces(dtype) ? (h0 + h1).to(at::kFloat)
                                : (h0.to(at::kFloat) + h1.to(at::kFloat)).to(dtype).to(at::kFloat);
        EXPECT_TRUE(out.equal(exact));
      }
    }
  });
}

// Swept over world sizes 1-8: allreduce, fp16 and bf16 average every rank's gradient (the
// compressed ones within their precision, summed over up to 8 ranks).
class HooksWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(HooksWorldTest, EveryHookAveragesOverTheWorld) {
  const int world = GetParam();
  at::Tensor want = at::zeros({27});
  for (int r = 0; r < world; ++r) want += values_for(r);
  want /= world;
  run_ranks_as_threads(world, [&](comm::Group& g) {
    AllReduceHook allreduce(g);
    OneBucket a(values_for(g.rank()));
    EXPECT_TRUE(a.run(allreduce).allclose(want, 1e-6, 1e-6)) << "allreduce, rank " << g.rank();
    for (at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
      CompressHook hook(g, dtype);
      OneBucket b(values_for(g.rank()));
      const at::Tensor out = b.run(hook);
      EXPECT_EQ(out.scalar_type(), at::kFloat);
      EXPECT_TRUE(out.allclose(want, 0, dtype == at::kHalf ? 3e-3 : 3e-2))
          << dtype << ", rank " << g.rank() << ": off by "
          << (out - want).abs().max().item<double>();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, HooksWorldTest, ::testing::Range(1, 9));

TEST(DefaultHooksTest, CompressHookReusesItsBufferAndGivesAFreshHooksValues) {
  // Three iterations on two buckets with new gradients each time: bit for bit what a new hook
  // gives, and one compressed buffer per bucket, not one per call. A call while the same
  // bucket's last call is still in flight must not share its buffer.
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    std::promise<void> rank0_called_promise;
    std::shared_future<void> rank0_called = rank0_called_promise.get_future().share();
    run_ranks_as_threads(2, [&](comm::Group& g) {
      CompressHook kept(g, dtype);
      for (int it = 0; it < 3; ++it) {
        for (int64_t index = 0; index < 2; ++index) {
          const at::Tensor values = values_for(g.rank()) * (it + 1) + static_cast<double>(index);
          OneBucket a(values), b(values);
          CompressHook fresh(g, dtype);
          c10d::GradBucket ga =
              make_grad_bucket(index, 2, a.buffer, {0, 24}, {24, 3}, a.sizes, a.params);
          c10d::GradBucket gb =
              make_grad_bucket(index, 2, b.buffer, {0, 24}, {24, 3}, b.sizes, b.params);
          auto fa = kept.runHook(ga);
          fa->wait();
          auto fb = fresh.runHook(gb);
          fb->wait();
          EXPECT_TRUE(kept.parseHookResult(fa->value()).equal(fresh.parseHookResult(fb->value())))
              << dtype << " iteration " << it << " bucket " << index;
        }
      }
      EXPECT_EQ(kept.buffers_allocated(), 2) << dtype;

      // Rank 0 makes two calls for bucket 0 before rank 1 makes any, so neither of rank 0's can
      // have finished when its second starts: the second must get its own buffer.
      OneBucket a(values_for(g.rank())), b(values_for(g.rank()) * 3);
      c10d::GradBucket ga = make_grad_bucket(0, 2, a.buffer, {0, 24}, {24, 3}, a.sizes, a.params);
      c10d::GradBucket gb = make_grad_bucket(0, 2, b.buffer, {0, 24}, {24, 3}, b.sizes, b.params);
      if (g.rank() == 1) rank0_called.wait();
      auto fa = kept.runHook(ga);
      auto fb = kept.runHook(gb);
      if (g.rank() == 0) {
        EXPECT_EQ(kept.buffers_allocated(), 3) << dtype;
        rank0_called_promise.set_value();
      }
      fa->wait();
      fb->wait();
      const at::Tensor want = (values_for(0) + values_for(1)) / 2;
      EXPECT_TRUE(a.buffer.allclose(want, 0, 2e-2)) << dtype;
      EXPECT_TRUE(b.buffer.allclose(want * 3, 0, 6e-2)) << dtype;
    });
  }
}

TEST(DefaultHooksTest, CompressWrapperAroundAllReduce) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    std::vector<at::ScalarType> dtypes = {at::kHalf, at::kBFloat16};
    for (at::ScalarType dtype : dtypes) {
      CompressWrapper hook(std::make_unique<AllReduceHook>(g), dtype);
      OneBucket b(values_for(g.rank()));
      at::Tensor out = b.run(hook);
      const at::Tensor want = (values_for(0) + values_for(1)) / 2;
      EXPECT_EQ(out.scalar_type(), at::kFloat);
      EXPECT_TRUE(out.allclose(want, 0, dtype == at::kHalf ? 2e-3 : 2e-2)) << dtype;
      EXPECT_FALSE(out.equal(want)) << "values went through " << dtype;
    }
  });
}

TEST(DefaultHooksTest, CompressWrapperAroundPowerSGD) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    auto state = std::make_shared<PowerSGDState>(g);
    state->start_powerSGD_iter = 2;
    state->iter = 2;
    CompressWrapper hook(std::make_unique<PowerSGDHook>(state), at::kHalf);
    // A rank-1 matrix: PowerSGD reproduces it up to float16 rounding.
    at::Tensor matrix =
        at::outer(at::cos(at::arange(6, at::kFloat)), at::sin(at::arange(4, at::kFloat) + 1));
    OneBucket b(at::cat({matrix.reshape(-1), at::ones({3})}));
    at::Tensor out = b.run(hook);
    EXPECT_TRUE(out.narrow(0, 0, 24).view({6, 4}).allclose(matrix, 0, 3e-2));
    EXPECT_EQ(state->p_memory_dict.at(0).scalar_type(), at::kHalf);
  });
}

TEST(DefaultHooksTest, PostLocalSGDSwitchesToTheSubgroup) {
  run_ranks_as_threads(4, [](comm::Group& g) {
    auto pairs = comm::new_subgroups(g, 2);
    ASSERT_TRUE(pairs.ok());
    auto state = std::make_shared<PostLocalSGDState>(g, pairs->mine, /*start_localSGD_iter=*/2);
    PostLocalSGDHook hook(state);
    const int pair = g.rank() / 2;
    for (int iter = 0; iter < 4; ++iter) {
      OneBucket b(values_for(g.rank()));
      at::Tensor out = b.run(hook);
      const at::Tensor global = (values_for(0) + values_for(1) + values_for(2) + values_for(3)) / 4;
      const at::Tensor local = (values_for(2 * pair) + values_for(2 * pair + 1)) / 2;
      EXPECT_TRUE(out.allclose(iter < 2 ? global : local, 1e-6, 1e-6)) << "iter " << iter;
    }
    EXPECT_EQ(state->iter, 2);  // counted only until local SGD starts, as PyTorch
    // Without post-local gradient all-reduce: no communication after the start.
    auto quiet = std::make_shared<PostLocalSGDState>(g, pairs->mine, 0,
                                                     /*post_local_gradient_allreduce=*/false);
    PostLocalSGDHook none(quiet);
    OneBucket b(values_for(g.rank()));
    EXPECT_TRUE(b.run(none).equal(values_for(g.rank())));
  });
}

}  // namespace
}  // namespace dtrain::ddp_hooks
