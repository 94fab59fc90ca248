#include "comm/coalesced.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"

namespace dtrain::comm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::run_ranks_as_threads;

std::vector<at::Tensor> mixed_tensors(double base) {
  return {at::full({3, 4}, base), at::full({5}, base + 1, at::kDouble),
          at::full({2, 2, 2}, base + 2), at::full({7}, base + 3, at::kDouble),
          at::full({1}, base + 4)};
}

TEST(CoalescedTest, FlattenAndUnflattenRoundTrip) {
  std::vector<at::Tensor> ts = {at::randn({2, 3}), at::randn({4}), at::randn({1, 1, 5})};
  at::Tensor flat = ::dtrain::comm::flatten_dense_tensors(ts);
  EXPECT_EQ(flat.numel(), 6 + 4 + 5);
  auto views = ::dtrain::comm::unflatten_dense_tensors(flat, ts);
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_TRUE(views[i].equal(ts[i]));
    EXPECT_EQ(views[i].data_ptr(), static_cast<char*>(flat.data_ptr()) + (i == 0   ? 0
                                                                          : i == 1 ? 6
                                                                                   : 10) *
                                                                             4);
  }
  views[1].fill_(9);  // views alias the buffer
  EXPECT_EQ(flat[6].item<float>(), 9);
}

TEST(CoalescedTest, BucketsPerDtypeUnderCap) {
  auto ts = mixed_tensors(0);  // float 48 B, double 40 B, float 32 B, double 56 B, float 4 B
  EXPECT_THAT(bucket_tensors(ts, 1 << 20), ElementsAre(ElementsAre(0, 2, 4), ElementsAre(1, 3)));
  EXPECT_THAT(bucket_tensors(ts, 50),
              ElementsAre(ElementsAre(0), ElementsAre(1), ElementsAre(2, 4), ElementsAre(3)));
}

TEST(CoalescedTest, MixedDtypeFlattenIsAnError) {
  try {
    ::dtrain::comm::flatten_dense_tensors(mixed_tensors(0));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("bucket by dtype first"));
  }
}

// Swept over world sizes 1-8 (gloo's collective tests sweep theirs the same way).
class CoalescedWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(CoalescedWorldTest, BroadcastAllReduceAllGather) {
  const int world = GetParam();
  run_ranks_as_threads(world, [world](Group& g) {
    const double r = g.rank();
    const int src = world - 1;
    // Broadcast from the last rank with a small cap: several buckets.
    auto ts = mixed_tensors(r * 10);
    CoalescedWork w = broadcast_coalesced(g, ts, src, /*bucket_cap_bytes=*/50);
    EXPECT_EQ(w.num_buckets(), 4u);
    w.wait();
    auto expected = mixed_tensors(src * 10);
    for (size_t i = 0; i < ts.size(); ++i) EXPECT_TRUE(ts[i].equal(expected[i])) << i;

    auto red = mixed_tensors(r);
    all_reduce_coalesced(g, red).wait();
    // sum over ranks of (r + k) = world * k + world (world - 1) / 2
    for (size_t k = 0; k < red.size(); ++k) {
      const double want = world * static_cast<double>(k) + world * (world - 1) / 2.0;
      EXPECT_TRUE(red[k].eq(want).all().item<bool>()) << k;
    }

    auto in = mixed_tensors(r);
    std::vector<std::vector<at::Tensor>> out(world);
    for (auto& o : out)
      for (auto& t : in) o.push_back(at::empty_like(t));
    all_gather_coalesced(g, in, out, 64).wait();
    for (int from = 0; from < world; ++from) {
      auto want = mixed_tensors(from);
      for (size_t i = 0; i < in.size(); ++i)
        EXPECT_TRUE(out[from][i].equal(want[i])) << from << "," << i;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CoalescedWorldTest, ::testing::Range(1, 9));

TEST(CoalescedTest, NonContiguousTensorsReceiveResults) {
  run_ranks_as_threads(2, [](Group& g) {
    at::Tensor base = at::full({4, 4}, static_cast<double>(g.rank() + 1));
    // Columns 0-1 through a transposed view, columns 2-3 through a strided one.
    std::vector<at::Tensor> ts = {base.t().narrow(0, 0, 2), base.narrow(1, 2, 2)};
    ASSERT_FALSE(ts[0].is_contiguous());
    ASSERT_FALSE(ts[1].is_contiguous());
    all_reduce_coalesced(g, ts).wait();
    EXPECT_TRUE(base.eq(3.0).all().item<bool>()) << base;
  });
}

// wire_view: 2-byte floats travel as their bytes (Gloo in sid's LibTorch has no bfloat16
// collectives), so a bfloat16 broadcast arrives bit for bit; other tensors go as they are.
TEST(CoalescedTest, WireViewSendsTwoByteFloatsAsBytes) {
  const at::Tensor h = at::randn({3, 5}).to(at::kBFloat16);
  EXPECT_EQ(wire_view(h).scalar_type(), at::kByte);
  EXPECT_EQ(wire_view(h).sizes(), (std::vector<int64_t>{3, 10}));
  EXPECT_EQ(wire_view(h.to(at::kHalf)).scalar_type(), at::kByte);
  EXPECT_EQ(wire_view(at::ones({}, at::kBFloat16)).sizes(), (std::vector<int64_t>{2}));
  const at::Tensor f = at::ones({4});
  EXPECT_TRUE(wire_view(f).is_same(f));
  const at::Tensor strided = h.t();  // no byte view: sent as it is
  EXPECT_TRUE(wire_view(strided).is_same(strided));
  run_ranks_as_threads(2, [](Group& g) {
    at::manual_seed(5);
    const at::Tensor want = at::randn({4, 7}).to(at::kBFloat16);
    at::Tensor got = g.rank() == 0 ? want.clone() : at::zeros_like(want);
    std::vector<at::Tensor> ts = {wire_view(got)};
    broadcast_coalesced(g, ts, 0).wait();
    EXPECT_TRUE(got.view(at::kShort).equal(want.view(at::kShort)));
  });
}

}  // namespace
}  // namespace dtrain::comm
