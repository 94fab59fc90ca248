#include "comm/testing/counting_group.h"

#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/libtorch_compat.h"
#include "comm/reduce_scatter.h"
#include "comm/testing/test_harness.h"

namespace dtrain::comm {
namespace {

using ::testing::HasSubstr;
using testing::run_ranks_as_threads;

// The formulas of counting_group.h, written out independently of the implementation.
int64_t ring_allreduce_bytes(int n, int64_t s) { return 2 * (n - 1) * s / n; }
int64_t share_bytes(int n, int64_t s) { return (n - 1) * s / n; }

void expect_counts(const std::map<std::string, CollectiveCounts>& got, const std::string& key,
                   int64_t calls, int64_t bytes) {
  auto it = got.find(key);
  ASSERT_NE(it, got.end()) << "no entry for \"" << key << "\"";
  EXPECT_EQ(it->second.calls, calls) << key;
  EXPECT_EQ(it->second.bytes, bytes) << key;
}

class CountingGroupTest : public ::testing::TestWithParam<int> {};

TEST_P(CountingGroupTest, CollectivesStayCorrectAndCountTheFormulas) {
  const int n = GetParam();
  run_ranks_as_threads(n, [n](Group& g) {
    auto counter = std::make_shared<ByteCounter>();
    Group counted = counting_group(g, counter);
    const int r = g.rank();

    // allreduce: 1001 floats (4004 bytes; 2(n-1)/n of it is not a whole number for n = 3).
    std::vector<at::Tensor> ar = {at::full({1001}, r + 1.0)};
    counted->allreduce(ar)->wait();
    EXPECT_TRUE(ar[0].equal(at::full({1001}, n * (n + 1) / 2.0)));
    // allreduce_coalesced: two doubles tensors, 3 + 4 elements (56 bytes), one call.
    std::vector<at::Tensor> arc = {at::full({3}, r + 1.0, at::kDouble),
                                   at::full({4}, 2.0 * r, at::kDouble)};
    counted->allreduce_coalesced(arc)->wait();
    EXPECT_TRUE(arc[0].equal(at::full({3}, n * (n + 1) / 2.0, at::kDouble)));
    EXPECT_TRUE(arc[1].equal(at::full({4}, 1.0 * n * (n - 1), at::kDouble)));

    // broadcast from rank 1: 10 doubles (80 bytes).
    std::vector<at::Tensor> bc = {at::full({10}, r == 1 ? 42.0 : -1.0, at::kDouble)};
    c10d::BroadcastOptions bo;
    bo.rootRank = 1;
    counted->broadcast(bc, bo)->wait();
    EXPECT_TRUE(bc[0].equal(at::full({10}, 42.0, at::kDouble)));

    // allgather: 7 floats in (28 bytes), n out; then allgather_coalesced of 3 + 4 floats (28
    // bytes). (_allgather_base: 1.13's Gloo has none, "no support for _allgather_base".)
    std::vector<at::Tensor> ag_in = {at::full({7}, r * 10.0)};
    std::vector<std::vector<at::Tensor>> ag_out(1);
    for (int j = 0; j < n; ++j) ag_out[0].push_back(at::empty({7}));
    counted->allgather(ag_out, ag_in)->wait();
    for (int j = 0; j < n; ++j) EXPECT_TRUE(ag_out[0][j].equal(at::full({7}, j * 10.0)));
    std::vector<at::Tensor> agc_in = {at::full({3}, r * 10.0), at::full({4}, r + 0.5)};
    std::vector<std::vector<at::Tensor>> agc_out(n);
    for (int j = 0; j < n; ++j) agc_out[j] = {at::empty({3}), at::empty({4})};
    counted->allgather_coalesced(agc_out, agc_in)->wait();
    for (int j = 0; j < n; ++j) {
      EXPECT_TRUE(agc_out[j][0].equal(at::full({3}, j * 10.0)));
      EXPECT_TRUE(agc_out[j][1].equal(at::full({4}, j + 0.5)));
    }
    // _allgather_base where the backend has it (LibTorch 2.x); where it throws (1.13 Gloo), on
    // every rank before any communication, the failed call is not counted.
    int allgathers = 2;
    at::Tensor agb_out = at::empty({n * 7});
    try {
      counted->_allgather_base(agb_out, ag_in[0])->wait();
      ++allgathers;
      for (int j = 0; j < n; ++j)
        EXPECT_TRUE(agb_out.narrow(0, j * 7, 7).equal(at::full({7}, j * 10.0)));
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("no support for _allgather_base"));
    }

    // reduce_scatter_tensor (comm/reduce_scatter.h): 5 floats per rank, input n*5 (n*20 bytes).
    at::Tensor rs_in = at::arange(n * 5, at::kFloat).add_(100 * r);
    at::Tensor rs_out = at::empty({5});
    reduce_scatter_tensor(counted, rs_out, rs_in).wait();
    EXPECT_TRUE(
        rs_out.equal(at::arange(5, at::kFloat).add_(r * 5).mul_(n).add_(100.0 * n * (n - 1) / 2)));

    counted->barrier()->wait();

    const auto got = counter->snapshot();
    expect_counts(got, "allreduce", 2, ring_allreduce_bytes(n, 4004) + ring_allreduce_bytes(n, 56));
    expect_counts(got, "broadcast", 1, share_bytes(n, 80));
    expect_counts(got, "allgather", allgathers, allgathers * (n - 1) * 28);
    // On Gloo, reduce_scatter_tensor is an all-to-all on every LibTorch version.
    expect_counts(got, "alltoall", 1, share_bytes(n, n * 20));
    expect_counts(got, "barrier", 1, 0);
    EXPECT_EQ(got.size(), 5u);
    // Hand-checked values, in case the formulas above and the implementation agree on a mistake.
    if (n == 3) {
      EXPECT_EQ(got.at("allreduce").bytes, 5338 + 74);  // 16016/3 rounded down, 224/3 likewise
      EXPECT_EQ(got.at("broadcast").bytes, 53);         // 160/3
      EXPECT_EQ(got.at("allgather").bytes, allgathers * 56);  // per call: 2 peers x 28
    }
    EXPECT_EQ(counter->total_bytes(), ring_allreduce_bytes(n, 4004) + ring_allreduce_bytes(n, 56) +
                                          share_bytes(n, 80) + allgathers * (n - 1) * 28 +
                                          share_bytes(n, n * 20));
    counter->reset();
    EXPECT_TRUE(counter->snapshot().empty());
    EXPECT_EQ(counter->total_bytes(), 0);
  });
}

TEST_P(CountingGroupTest, RootedAndPointToPointCounts) {
  const int n = GetParam();
  run_ranks_as_threads(n, [n](Group& g) {
    auto counter = std::make_shared<ByteCounter>();
    Group counted = counting_group(g, counter);
    const int r = g.rank();
    const int root = n - 1;

    // reduce to the last rank: 6 floats (24 bytes).
    std::vector<at::Tensor> rd = {at::full({6}, r + 1.0)};
    c10d::ReduceOptions ro;
    ro.rootRank = root;
    counted->reduce(rd, ro)->wait();
    if (r == root) {
      EXPECT_TRUE(rd[0].equal(at::full({6}, n * (n + 1) / 2.0)));
    }

    // gather to the root: 4 floats (16 bytes) each.
    std::vector<at::Tensor> ga_in = {at::full({4}, 1.0 * r)};
    std::vector<std::vector<at::Tensor>> ga_out;
    if (r == root) {
      ga_out.resize(1);
      for (int j = 0; j < n; ++j) ga_out[0].push_back(at::empty({4}));
    }
    c10d::GatherOptions go;
    go.rootRank = root;
    counted->gather(ga_out, ga_in, go)->wait();
    if (r == root) {
      for (int j = 0; j < n; ++j) EXPECT_TRUE(ga_out[0][j].equal(at::full({4}, 1.0 * j)));
    }

    // scatter from the root: 3 doubles (24 bytes) to each.
    std::vector<at::Tensor> sc_out = {at::empty({3}, at::kDouble)};
    std::vector<std::vector<at::Tensor>> sc_in;
    if (r == root) {
      sc_in.resize(1);
      for (int j = 0; j < n; ++j) sc_in[0].push_back(at::full({3}, 7.0 * j, at::kDouble));
    }
    c10d::ScatterOptions so;
    so.rootRank = root;
    counted->scatter(sc_out, sc_in, so)->wait();
    EXPECT_TRUE(sc_out[0].equal(at::full({3}, 7.0 * r, at::kDouble)));

    // send / recv: rank 0 sends 9 floats (36 bytes) to rank 1.
    if (r == 0) {
      std::vector<at::Tensor> t = {at::full({9}, 5.0)};
      counted->send(t, 1, /*tag=*/3)->wait();
    } else if (r == 1) {
      std::vector<at::Tensor> t = {at::zeros({9})};
      counted->recv(t, 0, /*tag=*/3)->wait();
      EXPECT_TRUE(t[0].equal(at::full({9}, 5.0)));
    }

    // alltoall_base: 2 ints per peer (n*8 bytes in).
    at::Tensor a_in = at::arange(2 * n, at::kInt).add_(100 * r);
    at::Tensor a_out = at::empty({2 * n}, at::kInt);
    std::vector<int64_t> equal;
    counted->alltoall_base(a_out, a_in, equal, equal)->wait();
    for (int j = 0; j < n; ++j) {
      EXPECT_TRUE(a_out.narrow(0, 2 * j, 2).equal(at::arange(2, at::kInt).add_(2 * r + 100 * j)));
    }

    const auto got = counter->snapshot();
    expect_counts(got, "reduce", 1, share_bytes(n, 24));
    expect_counts(got, "gather", 1, r == root ? 0 : 16);
    expect_counts(got, "scatter", 1, r == root ? (n - 1) * 24 : 0);
    if (r == 0) expect_counts(got, "send", 1, 36);
    if (r == 1) expect_counts(got, "recv", 1, 0);
    expect_counts(got, "alltoall", 1, share_bytes(n, n * 8));
  });
}

TEST_P(CountingGroupTest, UnderlyingGroupAndItsUsersAreUnaffected) {
  const int n = GetParam();
  run_ranks_as_threads(n, [n](Group& g) {
    const auto inner_before = g.pg();
    auto counter = std::make_shared<ByteCounter>();
    Group counted = counting_group(g, counter);

    // Same ranks, stores, timeout and backend; a different c10d object; the original untouched.
    EXPECT_EQ(g.pg().get(), inner_before.get());
    EXPECT_NE(counted.pg().get(), g.pg().get());
    EXPECT_EQ(counted.rank(), g.rank());
    EXPECT_EQ(counted.size(), n);
    EXPECT_EQ(counted.global_ranks(), g.global_ranks());
    EXPECT_EQ(counted.world_rank(), g.world_rank());
    EXPECT_EQ(counted.backend(), g.backend());
    EXPECT_EQ(counted.timeout(), g.timeout());
    EXPECT_EQ(counted.store().get(), g.store().get());
    EXPECT_EQ(counted.root_store().get(), g.root_store().get());
    EXPECT_EQ(counted->getBackendName(), g->getBackendName());

    // Calls through the original and the wrapper interleave as on one group; only the
    // wrapper's are counted.
    std::vector<at::Tensor> a = {at::full({8}, 1.0)};
    std::vector<at::Tensor> b = {at::full({8}, 2.0)};
    std::vector<at::Tensor> c = {at::full({8}, 3.0)};
    auto wa = g->allreduce(a);
    auto wb = counted->allreduce(b);
    auto wc = g->allreduce(c);
    wa->wait();
    wb->wait();
    wc->wait();
    EXPECT_TRUE(a[0].equal(at::full({8}, 1.0 * n)));
    EXPECT_TRUE(b[0].equal(at::full({8}, 2.0 * n)));
    EXPECT_TRUE(c[0].equal(at::full({8}, 3.0 * n)));
    at::Tensor out = at::empty({4});
    reduce_scatter_tensor(g, out, at::ones({4 * n})).wait();
    EXPECT_TRUE(out.equal(at::full({4}, 1.0 * n)));

    const auto got = counter->snapshot();
    ASSERT_EQ(got.size(), 1u);
    expect_counts(got, "allreduce", 1, ring_allreduce_bytes(n, 32));
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, CountingGroupTest, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return "world" + std::to_string(p.param);
                         });

TEST(ByteCounterTest, ThreadSafeSums) {
  ByteCounter counter;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&counter, t] {
      for (int i = 0; i < 1000; ++i) counter.add(t % 2 == 0 ? "allreduce" : "broadcast", t + 1);
    });
  }
  for (auto& t : threads) t.join();
  const auto got = counter.snapshot();
  expect_counts(got, "allreduce", 2000, 1000 * (1 + 3));
  expect_counts(got, "broadcast", 2000, 1000 * (2 + 4));
  EXPECT_EQ(counter.total_bytes(), 10000);
}

TEST(ByteCounterTest, MisuseIsAClearError) {
  ByteCounter counter;
  try {
    counter.add("allreduce", -1);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("cannot be negative"));
  }
  run_ranks_as_threads(1, [](Group& g) {
    try {
      counting_group(g, nullptr);
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("the counter is null"));
    }
  });
}

}  // namespace
}  // namespace dtrain::comm
