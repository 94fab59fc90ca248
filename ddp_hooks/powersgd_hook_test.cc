#include "ddp_hooks/powersgd_hook.h"

#include <atomic>
#include <chrono>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"
#include "ddp_hooks/libtorch_compat.h"

namespace dtrain::ddp_hooks {
namespace {

using comm::testing::run_ranks_as_threads;
using ::testing::HasSubstr;

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
  c10d::GradBucket bucket() {
    return make_grad_bucket(0, 1, buffer, offsets, lengths, sizes, params);
  }
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

// Rank 2, compressing the 8x6 matrix of a TestBucket ((8 + 6) * 2 numbers instead of 48), from
// iteration 2.
std::shared_ptr<PowerSGDState> configured(comm::Group& g) {
  auto s = make_state(g, 2);
  s->matrix_approximation_rank = 2;
  s->min_compression_rate = 1;
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
      c10::intrusive_ptr<c10::ivalue::Future> done = hook.runHook(gb);
      done->waitAndThrow();
      at::Tensor out = hook.parseHookResult(done->value());
      EXPECT_TRUE(out.is_same(b.buffer));
      EXPECT_TRUE(b.matrix().allclose(at::outer(u(), v()) * 1.5, 1e-9, 1e-9)) << "iter " << iter;
      EXPECT_TRUE(b.vec().allclose(at::arange(5, at::kDouble) * 1.5))
          << "1-D tensors: exact average";
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
    hook.runHook(gb)->waitAndThrow();
    EXPECT_TRUE(b.matrix().allclose(full_rank * 1.5))
        << "a full-rank gradient is averaged exactly before start";
    EXPECT_TRUE(state->error_dict.empty());
  });
}

TEST(PowerSGDTest, ErrorFeedbackCarriesTheResidualAndWarmStartConverges) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    auto state = make_state(g, 2);
    state->iter = 2;  // compress from the first call
    PowerSGDHook hook(state);
    // Rank 2 target: dominant u v^T plus a weaker orthogonal-ish component.
    const at::Tensor m =
        at::outer(u(), v()) * 3 +
        at::outer(at::sin(at::arange(8, at::kDouble) * 2), at::cos(at::arange(6, at::kDouble) * 3));
    TestBucket first(m, at::zeros({5}, at::kDouble));
    auto gb = first.bucket();
    hook.runHook(gb)->waitAndThrow();
    // The residual of this call is remembered exactly.
    EXPECT_TRUE(state->error_dict.at(0).narrow(0, 0, 48).view({8, 6}).allclose(m - first.matrix(),
                                                                               1e-9, 1e-9));
    // With warm start, repeated compression of the same matrix is a power iteration: the
    // approximation approaches the best rank-1 one (SVD).
    auto [U, S, V] = at::linalg_svd(m, /*full_matrices=*/false);
    const double best =
        (m - S[0].item<double>() * at::outer(U.select(1, 0), V.select(0, 0))).norm().item<double>();
    state->use_error_feedback = false;  // look at the approximation alone
    double err = 0;
    for (int i = 0; i < 15; ++i) {
      TestBucket b(m, at::zeros({5}, at::kDouble));
      auto bb = b.bucket();
      hook.runHook(bb)->waitAndThrow();
      err = (m - b.matrix()).norm().item<double>();
    }
    EXPECT_NEAR(err, best, 1e-6 * m.norm().item<double>());
  });
}

// runHook hands the bucket to the group's hook thread and returns: backward is not held while a
// peer is late to the all-reduces (PyTorch chains them with then). Rank 1 comes only after rank
// 0's runHook has returned (order, not a time bound: were runHook to wait for rank 1, the test
// would hang and fail); rank 0's future completes once rank 1 is there, with the same result.
TEST(PowerSGDTest, RunHookDoesNotWaitForTheCollectives) {
  std::atomic<bool> rank0_returned{false};
  run_ranks_as_threads(2, [&](comm::Group& g) {
    auto state = make_state(g, 2);
    state->iter = 2;  // compress from the first call: three all-reduces
    PowerSGDHook hook(state);
    TestBucket b(at::outer(u(), v()) * (g.rank() + 1.0), at::ones({5}, at::kDouble));
    auto gb = b.bucket();
    while (g.rank() == 1 && !rank0_returned.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    c10::intrusive_ptr<c10::ivalue::Future> done = hook.runHook(gb);
    if (g.rank() == 0) {
      EXPECT_FALSE(done->completed()) << "runHook waited for rank 1";
      rank0_returned = true;
    }
    done->waitAndThrow();
    EXPECT_TRUE(b.matrix().allclose(at::outer(u(), v()) * 1.5, 1e-9, 1e-9));
    EXPECT_EQ(state->iter, 3);
  });
}

TEST(PowerSGDTest, StateDictResumesIdentically) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    auto a = configured(g);
    a->iter = 2;
    PowerSGDHook hook_a(a);
    const at::Tensor m = at::sin(at::arange(48, at::kDouble).view({8, 6}) * (0.3 + g.rank()));
    for (int i = 0; i < 3; ++i) {
      TestBucket b(m, at::ones({5}, at::kDouble));
      auto gb = b.bucket();
      hook_a.runHook(gb)->waitAndThrow();
    }
    ASSERT_EQ(a->p_memory_dict.at(0).numel(), 8 * 2)
        << "the matrix is compressed: P and Q memories are resumed";
    auto saved = a->state_dict();
    auto b_state = configured(g);  // constructed as `a` was: a state is resumed, not reconfigured
    ASSERT_TRUE(b_state->load_state_dict(saved, /*expected_iter=*/a->iter).ok());
    PowerSGDHook hook_b(b_state);
    TestBucket x(m, at::ones({5}, at::kDouble)), y(m, at::ones({5}, at::kDouble));
    auto gx = x.bucket();
    auto gy = y.bucket();
    hook_a.runHook(gx)->waitAndThrow();
    hook_b.runHook(gy)->waitAndThrow();
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
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or "
                            "`warm_start` is enabled"));
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
      at::Tensor buffer =
          at::cat({at::outer(at::cos(at::arange(4, at::kDouble)), v()).reshape(-1),
                   at::outer(at::sin(at::arange(4, at::kDouble) + 2), v()).reshape(-1)});
      std::vector<at::Tensor> params = {at::zeros({4, 6}), at::zeros({4, 6})};
      std::vector<c10::IntArrayRef> sizes = {params[0].sizes(), params[1].sizes()};
      c10d::GradBucket gb = make_grad_bucket(0, 1, buffer, {0, 24}, {24, 24}, sizes, params);
      const at::Tensor before = buffer.clone();
      hook.runHook(gb)->waitAndThrow();
      EXPECT_TRUE(buffer.allclose(before, 1e-9, 1e-9))
          << (batched ? "batched" : "unbatched") << ": rank-1 inputs are exact";
    }
  });
}

// The hook's first compression of an 8x6 matrix at rank 2, by hand: Q drawn on the CPU by a
// generator seeded from the state's std::mt19937_64 (PyTorch: torch.manual_seed(rng.randint(1e9))
// and torch.randn on the CPU), then P = M Q and Q = M^T P, each orthogonalised. Bit for bit what
// the hook has drawn since its first version, whatever device its buckets are on.
TEST(PowerSGDTest, RandomMatricesAreDrawnOnTheCpuFromTheSeededStream) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    auto state = configured(g);
    state->iter = 2;
    state->random_seed = 7;
    PowerSGDHook hook(state);
    const at::Tensor m = at::sin(at::arange(48, at::kDouble).view({8, 6}) * 0.3);
    TestBucket b(m, at::ones({5}, at::kDouble));
    auto gb = b.bucket();
    hook.runHook(gb)->waitAndThrow();

    std::mt19937_64 rng(7);
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(rng() % 1000000000ULL);
    at::Tensor q = at::randn({1, 6, 2}, gen, at::TensorOptions().dtype(at::kDouble));
    orthogonalize(q, 0);
    at::Tensor p = at::empty({1, 8, 2}, at::kDouble);
    at::bmm_out(p, m.unsqueeze(0), q);
    orthogonalize(p, 0);
    at::bmm_out(q, m.unsqueeze(0).transpose(1, 2), p);
    EXPECT_TRUE(state->p_memory_dict.at(0).equal(p.reshape(-1)));
    EXPECT_TRUE(state->q_memory_dict.at(0).equal(q.reshape(-1)));
    EXPECT_TRUE(b.matrix().equal(at::bmm(p, q.transpose(1, 2))[0]));
    std::ostringstream advanced;
    advanced << rng;
    const c10::IValue saved = state->state_dict();
    const std::string saved_rng = saved.toGenericDict().at("rng").toStringRef();
    EXPECT_EQ(saved_rng, advanced.str()) << "one draw from the seeded stream";
  });
}

// CUDA buckets (skipped without a device): the same random Qs as on the CPU, memories on the
// device, state_dict() on the CPU, a loaded state moved to the device at its first use.
TEST(PowerSGDTest, CudaBucketsDrawOnTheCpuAndKeepTheirStateOnTheDevice) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  run_ranks_as_threads(1, [](comm::Group& g) {
    const at::Tensor m = at::sin(at::arange(48, at::kDouble).view({8, 6}) * 0.3);
    auto run = [&](const std::shared_ptr<PowerSGDState>& s, bool cuda) {
      PowerSGDHook hook(s);
      TestBucket layout(m, at::ones({5}, at::kDouble));
      at::Tensor buffer = cuda ? layout.buffer.cuda() : layout.buffer;
      c10d::GradBucket gb = make_grad_bucket(0, 1, buffer, layout.offsets, layout.lengths,
                                             layout.sizes, layout.params);
      hook.runHook(gb)->waitAndThrow();
      return buffer.cpu();
    };
    auto make = [&] {
      auto s = configured(g);
      s->iter = 2;
      return s;
    };
    auto on_cpu = make(), on_gpu = make();
    for (int i = 0; i < 3; ++i)
      EXPECT_TRUE(run(on_gpu, true).allclose(run(on_cpu, false), 1e-9, 1e-9)) << "step " << i;
    EXPECT_TRUE(on_gpu->error_dict.at(0).is_cuda());
    EXPECT_TRUE(on_gpu->p_memory_dict.at(0).is_cuda());
    const c10::IValue saved = on_gpu->state_dict();
    for (const char* key : {"error_dict", "p_memory_dict", "q_memory_dict"}) {
      EXPECT_TRUE(
          saved.toGenericDict().at(key).toGenericDict().at(int64_t{0}).toTensor().device().is_cpu())
          << key;
    }
    auto resumed = make();
    ASSERT_TRUE(resumed->load_state_dict(saved, on_gpu->iter).ok());
    EXPECT_TRUE(resumed->error_dict.at(0).device().is_cpu());
    EXPECT_TRUE(run(resumed, true).allclose(run(on_gpu, true), 1e-12, 1e-12));
    EXPECT_TRUE(resumed->error_dict.at(0).is_cuda());
    EXPECT_TRUE(resumed->q_memory_dict.at(0).is_cuda());
  });
}

// A state that compressed bucket 0 (an 8x6 matrix and a 5-vector, rank 2) three times: iter 5,
// error, P (16 numbers) and Q (12 numbers) memories for bucket 0.
std::shared_ptr<PowerSGDState> trained(comm::Group& g) {
  auto s = configured(g);
  s->iter = 2;
  PowerSGDHook hook(s);
  for (int i = 0; i < 3; ++i) {
    TestBucket b(at::sin(at::arange(48, at::kDouble).view({8, 6}) * 0.3),
                 at::ones({5}, at::kDouble));
    auto gb = b.bucket();
    hook.runHook(gb)->waitAndThrow();
  }
  return s;
}

// A state constructed as trained()'s was, to resume into.
std::shared_ptr<PowerSGDState> resuming(comm::Group& g) { return configured(g); }

// trained()'s state_dict with entries replaced: what a checksum-valid but hostile file holds.
c10::IValue hostile(comm::Group& g, std::vector<std::pair<std::string, c10::IValue>> changes) {
  c10::impl::GenericDict d = trained(g)->state_dict().toGenericDict();
  for (auto& [key, value] : changes) d.insert_or_assign(key, value);
  return d;
}

c10::impl::GenericDict bucket0(at::Tensor t) {
  c10::impl::GenericDict d(c10::IntType::get(), c10::TensorType::get());
  d.insert(int64_t{0}, std::move(t));
  return d;
}

// The message of a refused load (the test fails when the load is accepted).
std::string refused(PowerSGDState& s, const c10::IValue& sd,
                    std::optional<int64_t> expected_iter = std::nullopt) {
  const absl::Status status = s.load_state_dict(sd, expected_iter);
  EXPECT_FALSE(status.ok()) << "a hostile state was accepted";
  return std::string(status.message());
}

// The message of the c10::Error the hook's first use of a loaded state throws.
std::string first_use_error(const std::shared_ptr<PowerSGDState>& s) {
  PowerSGDHook hook(s);
  TestBucket b(at::sin(at::arange(48, at::kDouble).view({8, 6}) * 0.3), at::ones({5}, at::kDouble));
  const at::Tensor before = b.buffer.clone();
  auto gb = b.bucket();
  try {
    hook.runHook(gb)->waitAndThrow();
  } catch (const c10::Error& e) {
    EXPECT_TRUE(b.buffer.equal(before)) << "refused before the bucket changed";
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "a loaded memory that does not fit the bucket was used";
  return "";
}

TEST(PowerSGDStateTest, RefusesAnIterOfAnotherStep) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    auto s = resuming(g);
    EXPECT_THAT(refused(*s, hostile(g, {{"iter", int64_t{7}}}), /*expected_iter=*/5),
                HasSubstr("PowerSGD state: 'iter' is 7, expected 5 (the iteration the checkpoint "
                          "was written at)"));
    EXPECT_TRUE(s->load_state_dict(trained(g)->state_dict(), 5).ok())
        << "the same state at its own step loads";
  });
}

TEST(PowerSGDStateTest, RefusesMemoriesBeforeTheStartIteration) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    auto s = resuming(g);
    s->start_powerSGD_iter = 10;
    EXPECT_THAT(
        refused(*s, hostile(g, {{"start_powerSGD_iter", int64_t{10}}, {"iter", int64_t{7}}})),
        HasSubstr("'iter' is 7, not after start_powerSGD_iter 10 (no compressed iteration yet), "
                  "but the state holds 1 'error_dict' and 1 'p_memory_dict' entries"));
  });
}

TEST(PowerSGDStateTest, RefusesANegativeIter) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    auto s = resuming(g);
    EXPECT_THAT(refused(*s, hostile(g, {{"iter", int64_t{-50}}})),
                HasSubstr("PowerSGD state: 'iter' is -50, expected an int in [0, 1000000000000]"));
    try {
      s->load_state_dict(hostile(g, {{"iter", int64_t{-50}}}));
      ADD_FAILURE() << "the throwing form accepted it";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("'iter' is -50"));
    }
  });
}

TEST(PowerSGDStateTest, RefusesARankOtherThanThisRuns) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    auto s = resuming(g);
    EXPECT_THAT(
        refused(*s, hostile(g, {{"matrix_approximation_rank", int64_t{1} << 40}})),
        HasSubstr(
            "'matrix_approximation_rank' is 1099511627776 in the checkpoint but 2 in this run's "
            "PowerSGDState"));
    EXPECT_EQ(s->matrix_approximation_rank, 2);
  });
}

TEST(PowerSGDStateTest, RefusesAMemoryOfTheWrongShape) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    auto s = resuming(g);
    EXPECT_THAT(
        refused(*s, hostile(g, {{"p_memory_dict", bucket0(at::zeros({4, 4}, at::kDouble))}})),
        HasSubstr("'p_memory_dict'[0] is a 2-D Strided tensor on cpu, expected a 1-D"));
    EXPECT_THAT(
        refused(*s, hostile(g, {{"q_memory_dict", bucket0(at::zeros({12}, at::kLong))}})),
        HasSubstr("'q_memory_dict'[0] is a Long tensor, expected Double, Float, Half or BFloat16"));
    // A length only the model can tell: refused at the first use, before anything changes.
    ASSERT_TRUE(
        s->load_state_dict(hostile(g, {{"p_memory_dict", bucket0(at::zeros({5}, at::kDouble))}}), 5)
            .ok());
    EXPECT_THAT(first_use_error(s),
                HasSubstr("the loaded state's 'p_memory_dict'[0] holds 5 Double numbers but "
                          "bucket 0 needs 16 Double"));
    auto t = resuming(g);
    ASSERT_TRUE(
        t->load_state_dict(hostile(g, {{"error_dict", bucket0(at::zeros({1}, at::kDouble))}}), 5)
            .ok());
    EXPECT_THAT(first_use_error(t),
                HasSubstr("'error_dict'[0] holds 1 Double numbers but bucket 0 needs 53 Double"));
  });
}

TEST(PowerSGDStateTest, RefusesAnIterStoredAsAString) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    auto s = resuming(g);
    EXPECT_THAT(refused(*s, hostile(g, {{"iter", std::string("7")}})),
                HasSubstr("PowerSGD state: 'iter' is a String, expected an int"));
  });
}

TEST(PowerSGDStateTest, RefusesADictOfAnotherKind) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    auto s = resuming(g);
    c10::impl::GenericDict optimizer(c10::StringType::get(), c10::AnyType::get());
    optimizer.insert("state", bucket0(at::zeros({3})));
    optimizer.insert("param_groups", int64_t{0});
    EXPECT_THAT(refused(*s, optimizer),
                HasSubstr("PowerSGD state: it has no 'matrix_approximation_rank'"));
    EXPECT_THAT(refused(*s, at::zeros({3})),
                HasSubstr("PowerSGD state: it is a Tensor, expected a dict"));
    c10::impl::GenericDict no_rng = trained(g)->state_dict().toGenericDict();
    EXPECT_EQ(no_rng.erase(c10::IValue("rng")), 1u);
    EXPECT_THAT(refused(*s, no_rng), HasSubstr("it has no 'rng'"));
    EXPECT_THAT(refused(*s, hostile(g, {{"lr", 0.1}})),
                HasSubstr("it has the key lr, expected only the 18 keys"));
  });
}

TEST(PowerSGDStateTest, ARefusedLoadChangesNothing) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    auto s = resuming(g);
    EXPECT_THAT(refused(*s, hostile(g, {{"rng", std::string("12 34")}})),
                HasSubstr("'rng' is not a std::mt19937_64 state"));
    EXPECT_EQ(s->iter, 0);
    EXPECT_TRUE(s->error_dict.empty() && s->p_memory_dict.empty() &&
                s->unchecked_error_buckets.empty());
    EXPECT_FALSE(s->rng_seeded);
  });
}

}  // namespace
}  // namespace dtrain::ddp_hooks
