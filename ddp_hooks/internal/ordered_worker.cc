#include "ddp_hooks/internal/ordered_worker.h"

#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include <ATen/ThreadLocalState.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace dtrain::ddp_hooks::internal {
namespace {

thread_local bool t_on_worker = false;

// The job's future's outcome, passed on to `out`.
void forward(c10::ivalue::Future& from, const OrderedWorker::FuturePtr& out) {
  if (from.hasError()) {
    out->setError(from.exception_ptr());
  } else {
    out->markCompleted(from.value());
  }
}

}  // namespace

std::shared_ptr<OrderedWorker> OrderedWorker::for_group(const comm::Group& group) {
  static std::mutex mu;
  static auto* workers = new std::map<const void*, std::weak_ptr<OrderedWorker>>();
  std::lock_guard<std::mutex> lock(mu);
  std::weak_ptr<OrderedWorker>& slot = (*workers)[group.pg().get()];
  std::shared_ptr<OrderedWorker> worker = slot.lock();
  if (worker == nullptr) {
    worker = std::make_shared<OrderedWorker>();
    slot = worker;
  }
  return worker;
}

OrderedWorker::~OrderedWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool OrderedWorker::on_worker_thread() { return t_on_worker; }

OrderedWorker::FuturePtr OrderedWorker::submit(Job job, const at::Tensor& like,
                                               size_t max_waiting) {
  if (t_on_worker) return job();  // a hook inside a hook: already in order
  std::vector<c10::Device> devices;
  std::optional<c10::Stream> stream;
  if (like.defined() && !like.device().is_cpu()) {
    devices.push_back(like.device());
    stream = c10::impl::VirtualGuardImpl(like.device().type()).getStream(like.device());
  }
  auto out = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get(), devices);
  auto task = [job = std::move(job), out, stream, tls = at::ThreadLocalState()] {
    at::ThreadLocalStateGuard tls_guard(tls);
    c10::OptionalStreamGuard stream_guard(stream);
    try {
      FuturePtr result = job();
      result->addCallback([out](c10::ivalue::Future& done) { forward(done, out); });
    } catch (...) {
      out->setError(std::current_exception());
    }
  };
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait(lock, [&] { return jobs_.size() < max_waiting; });
  jobs_.push_back(std::move(task));
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  lock.unlock();
  changed_.notify_all();
  return out;
}

void OrderedWorker::run() {
  t_on_worker = true;
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and nothing left
      task = std::move(jobs_.front());
      jobs_.pop_front();
    }
    changed_.notify_all();  // a submit may wait for room
    task();
  }
}

}  // namespace dtrain::ddp_hooks::internal
