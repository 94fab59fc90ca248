// comm/ on a GPU (tags = ["gpu"]; comm/testing/gpu_testing.h): NCCL at world size 1 through every
// collective path dtrain uses, Gloo with CUDA tensors on two ranks sharing the GPU, and stream
// order: a collective issued right after a long kernel still sees that kernel's result.
#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/agreement.h"
#include "comm/coalesced.h"
#include "comm/object_collectives.h"
#include "comm/process_group.h"
#include "comm/reduce_scatter.h"
#include "comm/testing/gpu_testing.h"
#include "comm/testing/test_harness.h"
#include "testing/test_util.h"

namespace dtrain::comm {
namespace {

using testing::run_ranks_as_threads;

at::TensorOptions on(const Group& g) { return at::TensorOptions().device(g.device()); }

TEST(NcclWorldOfOneTest, GroupDeviceIsTheCurrentGpu) {
  DTRAIN_GPU_TEST_OR_SKIP();
  run_ranks_as_threads(
      1,
      [](Group& g) {
        EXPECT_EQ(g.backend(), "nccl");
        EXPECT_TRUE(g.device().is_cuda()) << g.device();
        EXPECT_EQ(g.device().index(), 0);
      },
      testing::with_backend("nccl"));
}

// comm::barrier as a group's first collective: on the group's GPU by default (PyTorch would guess
// the current device, warning), on the ids given, and an id that is no GPU here is named. With one
// GPU the guess would be right too: only the refusal can fail here.
TEST(NcclWorldOfOneTest, BarrierRunsOnTheGroupsGpu) {
  DTRAIN_GPU_TEST_OR_SKIP();
  run_ranks_as_threads(
      1,
      [](Group& g) {
        barrier(g)->wait();
        barrier(g, {g.device().index()})->wait();
        test_util::expect_error([&] { barrier(g, {99}); },
                                "device id 99 is not a GPU visible here");
      },
      testing::with_backend("nccl"));
}

// destroy_process_group shuts NCCL's communicator down after a collective; the group then refuses.
TEST(NcclWorldOfOneTest, DestroyShutsTheCommunicatorDown) {
  DTRAIN_GPU_TEST_OR_SKIP();
  run_ranks_as_threads(
      1,
      [](Group& g) {
        std::vector<at::Tensor> t = {at::ones({4}, on(g))};
        g->allreduce(t)->wait();
        destroy_process_group(g);
        test_util::expect_error([&] { (void)g.rank(); }, "was destroyed by destroy_process_group");
      },
      testing::with_backend("nccl"));
}

// A collective that cannot finish within the group's timeout -- queued behind seconds of fp32
// matrix products, timeout 2 s -- makes wait() throw naming it (nccl_blocking_wait, dtrain's
// default), neither hanging nor the watchdog taking the process down. In a process of its own:
// NCCL aborts the communicator after a timeout.
TEST(NcclWorldOfOneTest, TimedOutCollectiveThrowsNamingIt) {
  DTRAIN_GPU_TEST_OR_SKIP();
  testing::HarnessOptions options = testing::with_backend("nccl");
  options.timeout = std::chrono::seconds(2);
  testing::run_ranks_as_processes(
      1,
      [](Group& g) {
        std::vector<at::Tensor> t = {at::ones({4}, on(g))};
        g->allreduce(t)->wait();  // NCCL makes its communicator here, synchronising the device
        // Few long kernels (~150 ms each in fp32 on an H100/H200), so that the host is not held
        // back by CUDA's launch queue and issues the all-reduce at once.
        const at::Tensor a = at::rand({16384, 16384}, on(g));
        at::Tensor c;
        for (int i = 0; i < 60; ++i) c = at::mm(a, a);
        const auto start = std::chrono::steady_clock::now();
        try {
          g->allreduce(t)->wait();
          ADD_FAILURE() << "the all-reduce's wait() returned after "
                        << std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::steady_clock::now() - start)
                               .count()
                        << " ms without an error (timeout 2000 ms)";
        } catch (const c10::Error& e) {
          const std::string what = e.what_without_backtrace();
          EXPECT_THAT(what, ::testing::HasSubstr("ALLREDUCE"));
          std::cerr << "wait() threw: " << what.substr(0, what.find('\n')) << "\n";
        }
        // 10x the 2 s timeout: a bound a loaded machine cannot miss (the ADD_FAILURE above
        // catches a wait() that returns after the queued kernels instead of throwing).
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
      },
      options);
}

TEST(NcclWorldOfOneTest, TensorCollectives) {
  DTRAIN_GPU_TEST_OR_SKIP();
  run_ranks_as_threads(
      1,
      [](Group& g) {
        std::vector<at::Tensor> t = {at::arange(8, on(g).dtype(at::kFloat))};
        g->allreduce(t)->wait();
        EXPECT_TRUE(t[0].cpu().equal(at::arange(8, at::kFloat)));
        c10d::BroadcastOptions bo;
        g->broadcast(t, bo)->wait();
        std::vector<std::vector<at::Tensor>> out = {{at::empty({8}, on(g))}};
        g->allgather(out, t)->wait();
        EXPECT_TRUE(out[0][0].cpu().equal(at::arange(8, at::kFloat)));
        at::Tensor shard = at::empty({8}, on(g));
        reduce_scatter_tensor(g, shard, t[0]).wait();
        EXPECT_TRUE(shard.cpu().equal(at::arange(8, at::kFloat)));
        g->barrier()->wait();
      },
      testing::with_backend("nccl"));
}

TEST(NcclWorldOfOneTest, ObjectCollectivesAndAgreement) {
  DTRAIN_GPU_TEST_OR_SKIP();
  run_ranks_as_threads(
      1,
      [](Group& g) {
        c10::IValue obj(std::string("hello"));
        ASSERT_TRUE(broadcast_object(g, obj, 0).ok());
        EXPECT_EQ(obj.toStringRef(), "hello");
        auto all = all_gather_object(g, c10::IValue(int64_t{7}));
        ASSERT_TRUE(all.ok()) << all.status();
        EXPECT_EQ((*all)[0].toInt(), 7);
        auto at0 = gather_object(g, c10::IValue(int64_t{9}), 0);
        ASSERT_TRUE(at0.ok()) << at0.status();
        EXPECT_EQ((*at0)[0].toInt(), 9);
        EXPECT_TRUE(check_identical(g, {"a", "b"}, "item").ok());
        absl::Status v = share_verdict(g, absl::InvalidArgumentError("bad"), 0);
        EXPECT_EQ(v.code(), absl::StatusCode::kInvalidArgument);
        absl::StatusOr<Group> sub = new_group(g, {0});
        ASSERT_TRUE(sub.ok()) << sub.status();
        EXPECT_EQ(sub->device(), g.device());
      },
      testing::with_backend("nccl"));
}

TEST(NcclWorldOfOneTest, CoalescedCollectives) {
  DTRAIN_GPU_TEST_OR_SKIP();
  run_ranks_as_threads(
      1,
      [](Group& g) {
        std::vector<at::Tensor> ts = {at::ones({3}, on(g)),
                                      at::full({5}, 2.0, on(g).dtype(at::kHalf))};
        all_reduce_coalesced(g, ts).wait();
        broadcast_coalesced(g, ts, 0).wait();
        EXPECT_TRUE(ts[0].cpu().equal(at::ones({3})));
        EXPECT_TRUE(ts[1].cpu().equal(at::full({5}, 2.0, at::kHalf)));
      },
      testing::with_backend("nccl"));
}

// One backend per device type (PyTorch's default with CUDA): CPU tensors over Gloo, CUDA tensors
// over NCCL, in one group; its own tensors (object collectives) on the CPU.
TEST(DeviceRoutedGroupTest, CpuTensorsOverGlooCudaTensorsOverNccl) {
  DTRAIN_GPU_TEST_OR_SKIP();
  run_ranks_as_threads(
      1,
      [](Group& g) {
        EXPECT_EQ(g.backend(), "cpu:gloo,cuda:nccl");
        EXPECT_TRUE(g.device().is_cpu());
        std::vector<at::Tensor> cpu = {at::ones({5})},
                                cuda = {at::ones({5}, at::Device(at::kCUDA, 0))};
        g->allreduce(cpu)->wait();
        g->allreduce(cuda)->wait();
        EXPECT_TRUE(cuda[0].cpu().equal(cpu[0]));
        auto all = all_gather_object(g, c10::IValue(int64_t{3}));
        ASSERT_TRUE(all.ok()) << all.status();
        g->barrier()->wait();
        std::vector<at::Tensor> mixed = {at::ones({1}), at::ones({1}, at::Device(at::kCUDA, 0))};
        EXPECT_THROW(g->allreduce(mixed), c10::Error);
      },
      testing::with_backend("cpu:gloo,cuda:nccl"));
}

// Gloo reduces CUDA tensors too (staging through the host): two ranks sharing one GPU.
TEST(GlooCudaTensorsTest, TwoRanksShareTheGpu) {
  DTRAIN_GPU_TEST_OR_SKIP();
  run_ranks_as_threads(2, [](Group& g) {
    const at::Device cuda(at::kCUDA, 0);
    std::vector<at::Tensor> t = {at::full({16}, g.rank() + 1.0, cuda)};
    g->allreduce(t)->wait();
    EXPECT_TRUE(t[0].cpu().equal(at::full({16}, 3.0)));
    std::vector<at::Tensor> ts = {at::full({4}, g.rank() + 0.0, cuda)};
    broadcast_coalesced(g, ts, 1).wait();
    EXPECT_TRUE(ts[0].cpu().equal(at::ones({4})));
    auto all = all_gather_object(g, c10::IValue(int64_t{g.rank()}));
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_EQ((*all)[1].toInt(), 1);
  });
}

// The input is written by a kernel queued behind ~100 ms of matrix products; the all-reduce is
// issued at once. A collective that did not order itself after the current stream would reduce
// the stale zeros.
TEST(StreamOrderTest, CollectiveSeesTheKernelQueuedBeforeIt) {
  DTRAIN_GPU_TEST_OR_SKIP();
  run_ranks_as_threads(
      1,
      [](Group& g) {
        at::Tensor a = at::rand({2048, 2048}, on(g)), b = at::rand({2048, 2048}, on(g)) / 2048;
        at::Tensor input = at::zeros({1 << 20}, on(g));
        for (int i = 0; i < 40; ++i) a = at::tanh(at::mm(a, b));
        input.add_(a.sum().isfinite().to(at::kFloat));  // 1 everywhere, once the products are done
        std::vector<at::Tensor> t = {input};
        g->allreduce(t)->wait();
        EXPECT_EQ(t[0].min().item<float>(), 1.0f);
      },
      testing::with_backend("nccl"));
}

}  // namespace
}  // namespace dtrain::comm
