#include "ddp_hooks/internal/ordered_worker.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include "comm/testing/test_harness.h"

namespace dtrain::ddp_hooks::internal {
namespace {

using namespace std::chrono_literals;
using FuturePtr = OrderedWorker::FuturePtr;

// The future's value once it completes (its error thrown).
c10::IValue get(const FuturePtr& f) {
  f->waitAndThrow();
  return f->value();
}

FuturePtr completed(const at::Tensor& t) {
  auto f = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  f->markCompleted(t);
  return f;
}

TEST(OrderedWorkerTest, RunsJobsInOrderOnItsOwnThreadWithoutHoldingTheCaller) {
  OrderedWorker worker;
  std::mutex mu;
  std::vector<int> order;
  std::atomic<bool> release{false};
  const std::thread::id caller = std::this_thread::get_id();
  std::vector<FuturePtr> futures;
  for (int i = 0; i < 8; ++i) {
    futures.push_back(worker.submit(
        [&, i] {
          EXPECT_NE(std::this_thread::get_id(), caller);
          EXPECT_TRUE(OrderedWorker::on_worker_thread());
          while (i == 0 && !release) std::this_thread::sleep_for(1ms);  // the first job is slow
          std::lock_guard<std::mutex> lock(mu);
          order.push_back(i);
          return completed(at::full({1}, i));
        },
        at::Tensor()));
  }
  EXPECT_FALSE(futures[0]->completed()) << "submit waited for the job";
  EXPECT_FALSE(OrderedWorker::on_worker_thread());
  release = true;
  for (int i = 0; i < 8; ++i) EXPECT_EQ(get(futures[i]).toTensor().item<int64_t>(), i);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(OrderedWorkerTest, TheFutureFollowsTheJobsFutureOrHoldsItsException) {
  OrderedWorker worker;
  auto later = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  FuturePtr pending = worker.submit([&] { return later; }, at::Tensor());
  FuturePtr thrown = worker.submit(
      []() -> FuturePtr { TORCH_CHECK(false, "the bucket does not fit"); }, at::Tensor());
  FuturePtr failed = worker.submit(
      [] {
        auto f = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
        f->setError(std::make_exception_ptr(std::runtime_error("collective timed out")));
        return f;
      },
      at::Tensor());
  thrown->wait();
  failed->wait();
  EXPECT_FALSE(pending->completed()) << "completed before the job's future";
  later->markCompleted(at::ones({2}));
  EXPECT_TRUE(get(pending).toTensor().equal(at::ones({2})));
  EXPECT_THROW(thrown->value(), c10::Error);  // the job's own exception type
  try {
    thrown->value();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the bucket does not fit"), std::string::npos);
  }
  EXPECT_TRUE(failed->hasError());
  EXPECT_NE(failed->tryRetrieveErrorMessage().find("collective timed out"), std::string::npos);
}

// A hook inside a hook (the ZeRO overlap hook around PowerSGD): the inner job runs at once, inline,
// so nothing waits for itself and the order stays the outer job's.
TEST(OrderedWorkerTest, ASubmitFromAWorkerRunsInline) {
  OrderedWorker outer, inner;
  FuturePtr f = outer.submit(
      [&] {
        const std::thread::id here = std::this_thread::get_id();
        FuturePtr nested = inner.submit(
            [&] {
              EXPECT_EQ(std::this_thread::get_id(), here);
              return completed(at::ones({1}));
            },
            at::Tensor());
        EXPECT_TRUE(nested->completed());
        return nested;
      },
      at::Tensor());
  EXPECT_TRUE(get(f).toTensor().equal(at::ones({1})));
}

TEST(OrderedWorkerTest, CarriesTheCallersGradMode) {
  OrderedWorker worker;
  FuturePtr on = worker.submit([] { return completed(at::full({1}, c10::GradMode::is_enabled())); },
                               at::Tensor());
  c10::NoGradGuard no_grad;
  FuturePtr off = worker.submit(
      [] { return completed(at::full({1}, c10::GradMode::is_enabled())); }, at::Tensor());
  EXPECT_EQ(get(on).toTensor().item<bool>(), true);
  EXPECT_EQ(get(off).toTensor().item<bool>(), false);
}

// max_waiting bounds the jobs waiting to start: with the worker stuck in a job, the next submit
// returns at once, the one after waits until the worker takes a job off the queue.
TEST(OrderedWorkerTest, SubmitWaitsForRoomBeyondMaxWaiting) {
  OrderedWorker worker;
  std::atomic<bool> release{false};
  auto stuck = [&] {
    while (!release) std::this_thread::sleep_for(1ms);
    return completed(at::ones({1}));
  };
  auto quick = [] { return completed(at::ones({1})); };
  worker.submit(stuck, at::Tensor(), 1);
  std::this_thread::sleep_for(50ms);  // the worker has taken it: the queue is empty
  worker.submit(quick, at::Tensor(), 1);
  std::atomic<bool> third_returned{false};
  std::thread third([&] {
    worker.submit(quick, at::Tensor(), 1)->wait();
    third_returned = true;
  });
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(third_returned) << "submit did not wait for room";
  release = true;
  third.join();
  EXPECT_TRUE(third_returned);
}

TEST(OrderedWorkerTest, OneWorkerPerGroupWhileHeld) {
  comm::testing::run_ranks_as_threads(1, [](comm::Group& g) {
    std::shared_ptr<OrderedWorker> a = OrderedWorker::for_group(g);
    std::shared_ptr<OrderedWorker> b = OrderedWorker::for_group(g);
    EXPECT_EQ(a.get(), b.get());
  });
}

// Ranks as threads, each submitting all-reduces of different sizes from jobs that sleep for random
// times: every rank's collectives pair up in submission order, and every sum is right.
TEST(OrderedWorkerTest, CollectivesFromJobsPairUpAcrossRanks) {
  for (int world : {2, 3, 4}) {
    comm::testing::run_ranks_as_threads(world, [world](comm::Group& g) {
      std::shared_ptr<OrderedWorker> worker = OrderedWorker::for_group(g);
      std::mt19937 rng(g.rank());
      std::vector<FuturePtr> futures;
      for (int i = 0; i < 12; ++i) {
        const int delay_ms = static_cast<int>(rng() % 5);
        futures.push_back(worker->submit(
            [&g, i, delay_ms] {
              std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
              std::vector<at::Tensor> t = {at::full({i + 1}, static_cast<float>(g.rank() + i))};
              return g->allreduce(t)->getFuture();
            },
            at::Tensor()));
      }
      for (int i = 0; i < 12; ++i) {
        const at::Tensor sum = get(futures[i]).toTensorVector()[0];
        const float expected = static_cast<float>(world * (world - 1) / 2 + world * i);
        EXPECT_EQ(sum.numel(), i + 1);
        EXPECT_TRUE(sum.eq(expected).all().item<bool>()) << "job " << i << " rank " << g.rank();
      }
    });
  }
}

}  // namespace
}  // namespace dtrain::ddp_hooks::internal
