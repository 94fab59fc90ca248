#include "ddp_hooks/powersgd_hook.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/test_harness.h"
#include "ddp_hooks/libtorch_compat.h"

namespace dtrain::ddp_hooks {
namespace {

using ::testing::HasSubstr;
using comm::testing::run_ranks_as_threads;

// A bucket holding an 8x6 matrix and a 5-vector, like DDP builds it.
struct TestBucket {
  at::Tensor buffer;
  std::vector<at::Tensor> params = {at::zeros({8, 6}), at::zeros({5})};
  std::vector<size_t> offsets = {0, 48}, lengths = {48, 5};
  std::vector<c10::IntArrayRef> sizes;
  TestBucket(const at::Tensor& matrix, const at::Tensor& vec) {
    buffer = at::cat({matrix.reshape(-1), vec});
    for (const auto& p : params) sizes.push_back(p.sizes());
  }
  c10d::GradBucket bucket() { return make_grad_bucket(0, 1, buffer, offsets, lengths, sizes, params); }
  at::Tensor matrix() const { return buffer.narrow(0, 0, 48).view({8, 6}); }
  at::Tensor vec() const { return buffer.narrow(0, 48, 5); }
};

at::Tensor u() { return at::cos(at::arange(8, at::kDouble)); }
at::Tensor v() { return at::sin(at::arange(6, at::kDouble) + 1); }

std::shared_ptr<PowerSGDState> make_state(comm::Group& g, int64_t start) {
  auto s = std::make_shared<PowerSGDState>(g);
  s->start_powerSGD_iter = start;
  return s;
}

TEST(PowerSGDTest, RankOneGradientsAreReproducedExactly) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    auto state = make_state(g, 2);
    PowerSGDHook hook(state);
    for (int iter = 0; iter < 4; ++iter) {
      const double scale = g.rank() + 1.0;  // ranks differ; the average is still rank 1
      TestBucket b(at::outer(u(), v()) * scale, at::arange(5, at::kDouble) * scale);
      auto gb = b.bucket();
      at::Tensor out = hook.parseHookResult(hook.runHook(gb)->value());
      EXPECT_TRUE(out.is_same(b.buffer));
      EXPECT_TRUE(b.matrix().allclose(at::outer(u(), v()) * 1.5, 1e-9, 1e-9)) << "iter " << iter;
      EXPECT_TRUE(b.vec().allclose(at::arange(5, at::kDouble) * 1.5)) << "1-D tensors: exact average";
    }
    EXPECT_EQ(state->iter, 4);
    // (8 + 6) * 1 numbers instead of 48 for the matrix, 5 for the vector, over 2 compressed iterations.
    EXPECT_GT(state->compression_rate(), 2.5);
  });
}

TEST(PowerSGDTest, PlainAllReduceBeforeStartIteration) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    auto state = make_state(g, 3);
    PowerSGDHook hook(state);
    const at::Tensor full_rank = at::eye(8, 6, at::kDouble) + 0.1;
    TestBucket b(full_rank * (g.rank() + 1), at::ones({5}, at::kDouble));
    auto gb = b.bucket();
    hook.runHook(gb);
    EXPECT_TRUE(b.matrix().allclose(full_rank * 1.5)) << "a full-rank gradient is averaged exactly before start";
    EXPECT_TRUE(state->error_dict.empty());
  });
}

TEST(PowerSGDTest, ErrorFeedbackCarriesTheResidualAndWarmStartConverges) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    auto state = make_state(g, 2);
    state->iter = 2;  // compress from the first call
    PowerSGDHook hook(state);
    // Rank 2 target: dominant u v^T plus a weaker orthogonal-ish component.
    const at::Tensor m = at::outer(u(), v()) * 3 + at::outer(at::sin(at::arange(8, at::kDouble) * 2), at::cos(at::arange(6, at::kDouble) * 3));
    TestBucket first(m, at::zeros({5}, at::kDouble));
    auto gb = first.bucket();
    hook.runHook(gb);
    // The residual of this call is remembered exactly.
    EXPECT_TRUE(state->error_dict.at(0).narrow(0, 0, 48).view({8, 6}).allclose(m - first.matrix(), 1e-9, 1e-9));
    // With warm start, repeated compression of the same matrix is a power iteration: the
    // approximation approaches the best rank-1 one (SVD).
    auto [U, S, V] = at::linalg_svd(m, /*full_matrices=*/false);
    const double best = (m - S[0].item<double>() * at::outer(U.select(1, 0), V.select(0, 0))).norm().item<double>();
    state->use_error_feedback = false;  // look at the approximation alone
    double err = 0;
    for (int i = 0; i < 15; ++i) {
      TestBucket b(m, at::zeros({5}, at::kDouble));
      auto bb = b.bucket();
      hook.runHook(bb);
      err = (m - b.matrix()).norm().item<double>();
    }
    EXPECT_NEAR(err, best, 1e-6 * m.norm().item<double>());
  });
}

TEST(PowerSGDTest, StateDictResumesIdentically) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    auto a = make_state(g, 2);
    a->iter = 2;
    a->matrix_approximation_rank = 2;
    PowerSGDHook hook_a(a);
    const at::Tensor m = at::sin(at::arange(48, at::kDouble).view({8, 6}) * (0.3 + g.rank()));
    for (int i = 0; i < 3; ++i) {
      TestBucket b(m, at::ones({5}, at::kDouble));
      auto gb = b.bucket();
      hook_a.runHook(gb);
    }
    auto saved = a->state_dict();
    auto b_state = make_state(g, 1000);
    b_state->load_state_dict(saved);
    PowerSGDHook hook_b(b_state);
    TestBucket x(m, at::ones({5}, at::kDouble)), y(m, at::ones({5}, at::kDouble));
    auto gx = x.bucket();
    auto gy = y.bucket();
    hook_a.runHook(gx);
    hook_b.runHook(gy);
    EXPECT_TRUE(x.buffer.equal(y.buffer));
    EXPECT_EQ(a->iter, b_state->iter);
  });
}

TEST(PowerSGDTest, RejectsStartIterationOneWithErrorFeedback) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    auto s = make_state(g, 1);
    try {
      PowerSGDHook hook(s);
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled"));
    }
  });
}

TEST(PowerSGDTest, BatchedSameShapeMatchesUnbatched) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    for (bool batched : {false, true}) {
      auto s = make_state(g, 2);
      s->iter = 2;
      s->batch_tensors_with_same_shape = batched;
      PowerSGDHook hook(s);
      // Two 4x6 matrices in one bucket (same shape).
      at::Tensor buffer = at::cat({at::outer(at::cos(at::arange(4, at::kDouble)), v()).reshape(-1),
                                   at::outer(at::sin(at::arange(4, at::kDouble) + 2), v()).reshape(-1)});
      std::vector<at::Tensor> params = {at::zeros({4, 6}), at::zeros({4, 6})};
      std::vector<c10::IntArrayRef> sizes = {params[0].sizes(), params[1].sizes()};
      c10d::GradBucket gb = make_grad_bucket(0, 1, buffer, {0, 24}, {24, 24}, sizes, params);
      const at::Tensor before = buffer.clone();
      hook.runHook(gb);
      EXPECT_TRUE(buffer.allclose(before, 1e-9, 1e-9)) << (batched ? "batched" : "unbatched") << ": rank-1 inputs are exact";
    }
  });
}

}  // namespace
}  // namespace dtrain::ddp_hooks
