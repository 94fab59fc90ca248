// PowerSGDState::check_state_dict / load_state_dict against the model's buckets, the rank and the
// world size, and the memories' values: everything a hook state file can get wrong is refused at
// load, on the rank that reads it, before any collective (the hook's first use used to be the
// first check of a memory's length, when the other ranks were already inside a collective).
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/testing/test_harness.h"
#include "ddp_hooks/distributed_data_parallel.h"
#include "ddp_hooks/libtorch_compat.h"
#include "ddp_hooks/powersgd_hook.h"

namespace dtrain::ddp_hooks {
namespace {

using comm::testing::run_ranks_as_threads;
using ::testing::HasSubstr;
using GenericDict = c10::impl::GenericDict;

// Two buckets: 0 holds a 12x10 matrix and a 12-vector, 1 an 8x6 and a 4x3 matrix and a 5-vector.
// At rank 1 the 12x10 and 8x6 matrices are compressed (P: 12 and 8, Q: 10 and 6 numbers); the
// 4x3 one is not worth it.
const std::vector<std::vector<std::vector<int64_t>>> kShapes = {{{12, 10}, {12}},
                                                                {{8, 6}, {4, 3}, {5}}};

std::vector<PowerSGDBucket> buckets(at::ScalarType dtype = at::kFloat) {
  std::vector<PowerSGDBucket> out;
  for (const auto& shapes : kShapes) out.push_back({shapes, dtype});
  return out;
}

std::shared_ptr<PowerSGDState> make_state(comm::Group& g, double epsilon = 0) {
  auto s = std::make_shared<PowerSGDState>(g);
  s->start_powerSGD_iter = 2;
  s->orthogonalization_epsilon = epsilon;
  return s;
}

// Runs the hook on both buckets for iteration `iter` with gradients fixed by (rank, iter, bucket);
// returns the buckets' contents after it.
std::vector<at::Tensor> step(PowerSGDHook& hook, int rank, int iter) {
  std::vector<at::Tensor> out;
  for (size_t b = 0; b < kShapes.size(); ++b) {
    std::vector<at::Tensor> params;
    std::vector<size_t> offsets, lengths;
    std::vector<c10::IntArrayRef> sizes;
    size_t numel = 0;
    for (const auto& shape : kShapes[b]) params.push_back(at::zeros(shape));
    for (const auto& p : params) {
      offsets.push_back(numel);
      lengths.push_back(static_cast<size_t>(p.numel()));
      sizes.push_back(p.sizes());
      numel += lengths.back();
    }
    at::Tensor buffer = at::sin(at::arange(static_cast<int64_t>(numel), at::kFloat) *
                                (0.1 + rank + 0.01 * iter + 0.3 * static_cast<double>(b)));
    c10d::GradBucket bucket =
        make_grad_bucket(b, kShapes.size(), buffer, offsets, lengths, sizes, params);
    hook.runHook(bucket)->waitAndThrow();
    out.push_back(buffer);
  }
  return out;
}

// Rank `g.rank()`'s state after 5 iterations (3 compressed) on `g`.
c10::IValue trained(comm::Group& g, double epsilon = 0) {
  auto s = make_state(g, epsilon);
  PowerSGDHook hook(s);
  for (int iter = 0; iter < 5; ++iter) step(hook, g.rank(), iter);
  return s->state_dict();
}

GenericDict edited(const c10::IValue& base, const std::string& key, c10::IValue value) {
  GenericDict d = base.toGenericDict().copy();
  d.insert_or_assign(key, std::move(value));
  return d;
}
GenericDict with_entry(const c10::IValue& base, const std::string& key, int64_t bucket,
                       std::optional<at::Tensor> t) {
  GenericDict m(c10::IntType::get(), c10::TensorType::get());
  for (const auto& kv : base.toGenericDict().at(key).toGenericDict())
    m.insert(kv.key(), kv.value());
  if (t.has_value()) {
    m.insert_or_assign(bucket, *t);
  } else {
    m.erase(bucket);
  }
  return edited(base, key, m);
}
at::Tensor entry(const c10::IValue& base, const std::string& key, int64_t bucket) {
  return base.toGenericDict().at(key).toGenericDict().at(bucket).toTensor();
}

const PowerSGDExpected kExpected{.iter = 5, .buckets = buckets(), .file = "/ck/hook-rank0.pt"};

// The message of a refused check; the state must be unchanged.
std::string refused(comm::Group& g, const c10::IValue& sd,
                    const PowerSGDExpected& expected = kExpected) {
  auto s = make_state(g);
  const absl::Status status = s->check_state_dict(sd, expected);
  EXPECT_FALSE(status.ok()) << "a hostile state was accepted";
  EXPECT_TRUE(absl::IsDataLoss(status) || absl::IsInvalidArgument(status)) << status;
  EXPECT_EQ(std::string(status.message()).find('\n'), std::string::npos) << "one line";
  EXPECT_EQ(s->load_state_dict(sd, expected), status) << "load refuses what check refuses";
  EXPECT_TRUE(s->iter == 0 && s->error_dict.empty() && s->q_memory_dict.empty());
  return std::string(status.message());
}

TEST(PowerSGDStateCheckTest, TheRanksOwnFileLoadsAndResumesIdentically) {
  run_ranks_as_threads(2, [](comm::Group& g) {
    auto a = make_state(g);
    PowerSGDHook hook_a(a);
    for (int iter = 0; iter < 5; ++iter) step(hook_a, g.rank(), iter);
    auto b = make_state(g);
    const PowerSGDExpected expected{.iter = 5, .buckets = buckets(), .file = "f"};
    ASSERT_TRUE(b->check_state_dict(a->state_dict(), expected).ok());
    EXPECT_EQ(b->iter, 0) << "check_state_dict changes nothing";
    ASSERT_TRUE(b->load_state_dict(a->state_dict(), expected).ok());
    EXPECT_TRUE(b->unchecked_memory_buckets.size() == 2 && b->iter == 5);
    PowerSGDHook hook_b(b);
    const std::vector<at::Tensor> x = step(hook_a, g.rank(), 5), y = step(hook_b, g.rank(), 5);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(x[i].equal(y[i])) << "bucket " << i;
  });
}

TEST(PowerSGDStateCheckTest, EveryMemoryOfTheWrongLengthOrDtypeIsRefusedNamingKeyAndBucket) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    const c10::IValue base = trained(g);
    for (const std::string key : {"error_dict", "p_memory_dict", "q_memory_dict"}) {
      for (int64_t b : {0, 1}) {
        const at::Tensor t = entry(base, key, b);
        const std::string where = "'" + key + "'[" + std::to_string(b) + "]";
        const std::string needs =
            " numbers, but bucket " + std::to_string(b) + " of this model needs ";
        EXPECT_THAT(refused(g, with_entry(base, key, b, at::zeros({5}))),
                    HasSubstr("PowerSGD state file /ck/hook-rank0.pt: " + where + " holds 5 Float" +
                              needs + std::to_string(t.numel()) + " Float"));
        EXPECT_THAT(refused(g, with_entry(base, key, b, at::cat({t, at::zeros({1})}))),
                    HasSubstr(where + " holds " + std::to_string(t.numel() + 1) + " Float" + needs +
                              std::to_string(t.numel()) + " Float"));
        EXPECT_THAT(refused(g, with_entry(base, key, b, t.narrow(0, 0, t.numel() - 1).clone())),
                    HasSubstr(where + " holds " + std::to_string(t.numel() - 1) + " Float"));
      }
    }
    for (at::ScalarType dtype : {at::kDouble, at::kHalf}) {
      const std::string name = c10::toString(dtype);
      EXPECT_THAT(
          refused(g, with_entry(base, "error_dict", 1, entry(base, "error_dict", 1).to(dtype))),
          HasSubstr("'error_dict'[1] holds 65 " + name +
                    " numbers, but bucket 1 of this "
                    "model needs 65 Float (the bucket's length)"));
      // P alone in another dtype: the pair disagrees; both: the bucket does.
      const GenericDict p =
          with_entry(base, "p_memory_dict", 0, entry(base, "p_memory_dict", 0).to(dtype));
      EXPECT_THAT(refused(g, p), HasSubstr("'p_memory_dict'[0] is " + name +
                                           " but 'q_memory_dict'[0] Float, expected both in the "
                                           "bucket's dtype"));
      EXPECT_THAT(
          refused(g, with_entry(p, "q_memory_dict", 0, entry(base, "q_memory_dict", 0).to(dtype))),
          HasSubstr("'p_memory_dict'[0] holds 12 " + name +
                    " numbers, but bucket 0 of this model needs 12 Float (n r per compressed n x "
                    "m matrix: 12x10 at rank 1)"));
    }
    EXPECT_TRUE(make_state(g)->check_state_dict(base, kExpected).ok()) << "the control loads";
  });
}

TEST(PowerSGDStateCheckTest, AMissingOrAnExtraBucketIsRefused) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    const c10::IValue base = trained(g);
    for (const std::string key : {"error_dict", "p_memory_dict", "q_memory_dict"}) {
      GenericDict missing = with_entry(base, key, 1, std::nullopt);
      if (key != "error_dict") {  // warm start keeps P and Q together: drop both
        missing = with_entry(with_entry(base, "p_memory_dict", 1, std::nullopt), "q_memory_dict", 1,
                             std::nullopt);
      }
      EXPECT_THAT(refused(g, missing),
                  HasSubstr(std::string(key == "error_dict" ? "'error_dict'" : "'p_memory_dict'") +
                            " has no entry for bucket 1, which the hook keeps for every bucket "
                            "from its first compressed iteration on ('iter' is 5, "
                            "start_powerSGD_iter 2)"));
      GenericDict extra = with_entry(base, key, 2, entry(base, key, 1));
      if (key != "error_dict") {
        extra = with_entry(with_entry(base, "p_memory_dict", 2, entry(base, "p_memory_dict", 1)),
                           "q_memory_dict", 2, entry(base, "q_memory_dict", 1));
      }
      EXPECT_THAT(refused(g, extra),
                  HasSubstr("[2] is for bucket 2, which this model does not have (it has 2 "
                            "buckets, 0 to 1)"));
    }
    // Without the model's buckets the loader cannot tell: the hook does, at their first use.
    auto s = make_state(g);
    EXPECT_TRUE(s->check_state_dict(with_entry(base, "error_dict", 1, std::nullopt),
                                    PowerSGDExpected{.iter = 5})
                    .ok());
  });
}

TEST(PowerSGDStateCheckTest, NonFiniteMemoriesAreRefusedEvenWithoutTheBuckets) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    const c10::IValue base = trained(g);
    const double inf = std::numeric_limits<double>::infinity();
    for (const std::string key : {"error_dict", "p_memory_dict", "q_memory_dict"}) {
      for (const auto& [value, name] : std::vector<std::pair<double, std::string>>{
               {std::nan(""), "NaN"}, {inf, "inf"}, {-inf, "-inf"}}) {
        at::Tensor t = entry(base, key, 0).clone();
        t[3] = value;
        const std::string message = "'" + key + "'[0] holds " + name + " at index 3 of " +
                                    std::to_string(t.numel()) + ", expected finite numbers";
        EXPECT_THAT(refused(g, with_entry(base, key, 0, t)), HasSubstr(message));
        EXPECT_THAT(refused(g, with_entry(base, key, 0, t), PowerSGDExpected{.iter = 5}),
                    HasSubstr("PowerSGD state: " + message));
      }
    }
  });
}

// With orthogonalization_epsilon 0 the next step divides each Q column by its norm: a Q of zeros
// trains NaN, in PyTorch's hook as in dtrain's. With an
// epsilon that is PyTorch's own state after a vanishing gradient, and it trains on, finite.
TEST(PowerSGDStateCheckTest, AQThatCannotBeOrthogonalisedIsRefusedWithoutEpsilon) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    const c10::IValue base = trained(g);
    const at::Tensor q1 = entry(base, "q_memory_dict", 1);  // the 8x6's Q (6 numbers)
    EXPECT_THAT(refused(g, with_entry(base, "q_memory_dict", 1, at::zeros_like(q1))),
                HasSubstr("'q_memory_dict'[1]: column 0 of the Q of gradient 0 (8x6, its numbers "
                          "0 to 5) orthogonalises to zeros: the next step divides by its "
                          "norm (orthogonalization_epsilon is 0) and trains NaN"));
    // The loaded memory is not touched by the check.
    EXPECT_TRUE(entry(base, "q_memory_dict", 1).equal(q1));

    const c10::IValue guarded = trained(g, /*epsilon=*/1e-8);
    GenericDict zero_q =
        with_entry(guarded, "q_memory_dict", 1, at::zeros_like(entry(guarded, "q_memory_dict", 1)));
    auto s = make_state(g, 1e-8);
    ASSERT_TRUE(s->load_state_dict(zero_q, kExpected).ok());
    PowerSGDHook hook(s);
    for (const at::Tensor& t : step(hook, 0, 5)) EXPECT_TRUE(at::isfinite(t).all().item<bool>());
  });
}

TEST(PowerSGDStateCheckTest, AZeroQColumnIsRefusedAtRankTwo) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    auto a = make_state(g);
    a->matrix_approximation_rank = 2;
    PowerSGDHook hook(a);
    for (int iter = 0; iter < 5; ++iter) step(hook, 0, iter);
    const c10::IValue base = a->state_dict();
    at::Tensor q = entry(base, "q_memory_dict", 0).clone();  // the 12x10's Q: 10 x 2
    q.view({10, 2}).select(1, 1).zero_();
    auto b = make_state(g);
    b->matrix_approximation_rank = 2;
    const absl::Status st = b->check_state_dict(with_entry(base, "q_memory_dict", 0, q), kExpected);
    EXPECT_THAT(std::string(st.message()),
                HasSubstr("'q_memory_dict'[0]: column 1 of the Q of gradient 0 (12x10, its "
                          "numbers 0 to 19)"));
    EXPECT_TRUE(b->check_state_dict(base, kExpected).ok());
  });
}

// All-zero error memories are what PyTorch's hook starts from and resets to: legal. The P memory
// is overwritten before it is read: zeros train the same step.
TEST(PowerSGDStateCheckTest, ZeroErrorAndPMemoriesAreLegalStates) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    const c10::IValue base = trained(g);
    auto original = make_state(g);
    ASSERT_TRUE(original->load_state_dict(base, kExpected).ok());
    PowerSGDHook original_hook(original);
    const std::vector<at::Tensor> reference = step(original_hook, 0, 5);

    auto zero_error = make_state(g);
    ASSERT_TRUE(zero_error
                    ->load_state_dict(with_entry(base, "error_dict", 0,
                                                 at::zeros_like(entry(base, "error_dict", 0))),
                                      kExpected)
                    .ok());
    PowerSGDHook error_hook(zero_error);
    for (const at::Tensor& t : step(error_hook, 0, 5))
      EXPECT_TRUE(at::isfinite(t).all().item<bool>());

    auto zero_p = make_state(g);
    ASSERT_TRUE(zero_p
                    ->load_state_dict(with_entry(base, "p_memory_dict", 0,
                                                 at::zeros_like(entry(base, "p_memory_dict", 0))),
                                      kExpected)
                    .ok());
    PowerSGDHook p_hook(zero_p);
    const std::vector<at::Tensor> next = step(p_hook, 0, 5);
    for (size_t b = 0; b < next.size(); ++b) EXPECT_TRUE(next[b].equal(reference[b])) << b;
  });
}

TEST(PowerSGDStateCheckTest, AnotherRanksOrWorldSizesFileIsRefused) {
  std::vector<c10::IValue> saved(2);
  run_ranks_as_threads(2, [&](comm::Group& g) { saved[g.rank()] = trained(g); });
  run_ranks_as_threads(2, [&](comm::Group& g) {
    const c10::IValue& other = saved[1 - g.rank()];
    EXPECT_THAT(refused(g, other),
                HasSubstr("'rank' is " + std::to_string(1 - g.rank()) + ", but this is rank " +
                          std::to_string(g.rank()) + ": it is another rank's hook state"));
    EXPECT_TRUE(make_state(g)->check_state_dict(saved[g.rank()], kExpected).ok());
  });
  run_ranks_as_threads(1, [&](comm::Group& g) {
    EXPECT_THAT(refused(g, saved[0]),
                HasSubstr("'world_size' is 2, but this run has 1 ranks: it was written by a job "
                          "of another size"));
    GenericDict legacy = trained(g).toGenericDict().copy();
    legacy.erase("rank");
    legacy.erase("world_size");
    EXPECT_THAT(
        refused(g, legacy),
        HasSubstr("PowerSGD state file /ck/hook-rank0.pt: it records no 'rank' and "
                  "'world_size' (a file written before dtrain recorded whose state it is)"));
    EXPECT_THAT(refused(g, edited(saved[0], "rank", int64_t{2})),
                HasSubstr("'rank' is 2, expected an int in [0, 1]"));
  });
}

TEST(PowerSGDStateCheckTest, MemoriesAtTheStartIterationAreRefused) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    // The hook compresses in the iteration that starts with iter == start_powerSGD_iter: a state
    // at that iter has compressed nothing.
    EXPECT_THAT(refused(g, edited(trained(g), "iter", int64_t{2}),
                        PowerSGDExpected{.iter = 2, .buckets = buckets()}),
                HasSubstr("'iter' is 2, not after start_powerSGD_iter 2 (no compressed "
                          "iteration yet), but the state holds 2 'error_dict'"));
  });
}

// powersgd_buckets(ddp) is what DistributedDataParallel hands the hook: a state the hook wrote
// under DDP fits it, and one element more does not.
TEST(PowerSGDStateCheckTest, TheBucketsOfADdpEngineAreWhatItsHookSees) {
  run_ranks_as_threads(1, [](comm::Group& g) {
    torch::manual_seed(0);
    auto net = torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Linear(16, 12),
                                     torch::nn::Linear(12, 3));
    DDPOptions o;
    o.group = g;
    o.first_bucket_cap_mb = 0.0005;  // the last layer alone in bucket 0
    DistributedDataParallel ddp(net.ptr(), o);
    auto state = make_state(g);
    ddp.register_comm_hook(std::make_unique<PowerSGDHook>(state));
    for (int i = 0; i < 4; ++i) {
      const at::Tensor x = torch::randn({5, 6}), y = torch::randn({5, 3});
      ddp.forward([&] { return torch::mse_loss(net->forward(x), y); }).backward();
    }
    const std::vector<PowerSGDBucket> b = powersgd_buckets(ddp);
    ASSERT_GE(b.size(), 2u);
    const PowerSGDExpected expected{.iter = 4, .buckets = b, .file = "f"};
    const c10::IValue saved = state->state_dict();
    EXPECT_TRUE(make_state(g)->check_state_dict(saved, expected).ok());
    for (const std::string key : {"error_dict", "p_memory_dict", "q_memory_dict"}) {
      const at::Tensor t = entry(saved, key, 1);
      EXPECT_THAT(
          std::string(make_state(g)
                          ->check_state_dict(
                              with_entry(saved, key, 1, at::cat({t, at::zeros({1})})), expected)
                          .message()),
          HasSubstr("'" + key + "'[1] holds " + std::to_string(t.numel() + 1)));
    }
    const PowerSGDExpected half{.iter = 4, .buckets = powersgd_buckets(ddp, at::kHalf)};
    EXPECT_THAT(std::string(make_state(g)->check_state_dict(saved, half).message()),
                HasSubstr("Float numbers, but bucket 0 of this model needs"));
  });
}

}  // namespace
}  // namespace dtrain::ddp_hooks
