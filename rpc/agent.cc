#include "rpc/agent.h"

#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <set>

#include <torch/csrc/distributed/rpc/message.h>
#include <torch/csrc/distributed/rpc/request_callback.h>
#include <torch/csrc/distributed/rpc/tensorpipe_agent.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/exception_status.h"
#include "comm/process_group.h"

namespace dtrain::rpc {
namespace tdr = torch::distributed::rpc;

struct Agent::InFlight {
  std::mutex mu;
  std::condition_variable cv;
  int64_t calls = 0;
};

// The shutdown barrier's state: per phase (0: arrived, 1: leaving), the ranks whose message
// reached this worker.
struct Agent::Arrivals {
  std::mutex mu;
  std::condition_variable cv;
  std::set<int64_t> ranks[2];
};

namespace {
// Worker W serves "dtrain.rpc.shutdown_arrived/W" (the prefix is reserved: Handlers' comment); its
// name in the handler keeps agents that share one Handlers object (threads of a test) apart.
std::string arrived_handler(const std::string& worker) {
  return absl::StrCat("dtrain.rpc.shutdown_arrived/", worker);
}
}  // namespace

void Handlers::add(const std::string& name, Handler handler) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  handlers_[name] = std::make_shared<const Handler>(std::move(handler));
}

std::shared_ptr<const Handler> Handlers::find(const std::string& name) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  auto it = handlers_.find(name);
  return it == handlers_.end() ? nullptr : it->second;
}

std::vector<std::string> Handlers::names() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& kv : handlers_) out.push_back(kv.first);
  return out;
}

namespace {

// dtrain's RPC carries CPU tensors only (no device maps, unlike TensorPipe's own): a CUDA tensor is
// refused before it reaches the transport, naming it and the fix. Empty when all are on the CPU.
std::string non_cpu_tensor(const std::vector<at::Tensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].defined() && !tensors[i].device().is_cpu()) {
      return absl::StrCat(
          "tensor ", i, " of this RPC message is on ", tensors[i].device().str(),
          ": dtrain's RPC sends CPU tensors only (no device maps); move it with .cpu() before "
          "the call and back with .to(device) where it is used");
    }
  }
  return "";
}

// The name a reply's envelope carries where a request's carries its handler's.
constexpr char kReplyName[] = "reply";

c10::intrusive_ptr<tdr::JitFuture> completed(c10::intrusive_ptr<tdr::Message> message) {
  auto future = c10::make_intrusive<tdr::JitFuture>(
      at::getCustomClassType<c10::intrusive_ptr<tdr::Message>>());
  auto [m, storages] = tdr::withStorages(std::move(message));
  future->markCompleted(c10::IValue(std::move(m)), std::move(storages));
  return future;
}

// Decodes the request, runs its handler, encodes the reply. Everything that goes wrong (a
// malformed message, an unknown handler, a handler's exception) becomes an EXCEPTION reply,
// which the caller's agent turns into an error: the agent itself never throws here.
class Callback : public tdr::RequestCallback {
 public:
  Callback(std::shared_ptr<Handlers> handlers, std::string self)
      : handlers_(std::move(handlers)), self_(std::move(self)) {}

 protected:
  c10::intrusive_ptr<tdr::JitFuture> processMessage(tdr::Message& request,
                                                    std::vector<c10::Stream>) const override {
    const int64_t id = request.id();
    std::string handler_name = "?";
    try {
      Envelope e = decode_envelope(request.payload(), request.tensors().size());
      handler_name = e.handler;
      std::shared_ptr<const Handler> handler = handlers_ ? handlers_->find(e.handler) : nullptr;
      if (handler == nullptr) {
        throw std::runtime_error(absl::StrCat("no handler named '", e.handler, "' is registered"));
      }
      Request r{std::move(e.caller), e.handler, std::move(e.body), std::move(request.tensors())};
      Reply reply = (*handler)(r);
      if (std::string bad = non_cpu_tensor(reply.tensors); !bad.empty())
        throw std::runtime_error(bad);
      std::vector<char> payload =
          encode_envelope(kReplyName, reply.body, reply.tensors.size(), self_);
      return completed(c10::make_intrusive<tdr::Message>(
          std::move(payload), std::move(reply.tensors), tdr::MessageType::SCRIPT_RET, id));
    } catch (...) {
      return error(handler_name, comm::current_exception_message(), id);
    }
  }

 private:
  c10::intrusive_ptr<tdr::JitFuture> error(const std::string& handler, const std::string& what,
                                           int64_t id) const {
    return completed(tdr::createExceptionResponse(
        absl::StrCat("worker '", self_, "', handler '", handler, "': ", what), id));
  }

  std::shared_ptr<Handlers> handlers_;
  std::string self_;
};

absl::Status call_error(const std::string& to, const std::string& message) {
  if (absl::StrContains(message, "timed out") ||
      absl::StrContains(message, "more than set timeout") ||
      absl::StrContains(message, "RPCErr:1:")) {
    return absl::DeadlineExceededError(
        absl::StrCat("RPC to worker '", to, "' timed out: ", message));
  }
  if (absl::StrContains(message, "worker '") && absl::StrContains(message, "handler '")) {
    return absl::InternalError(absl::StrCat("RPC to worker '", to, "' failed remotely: ", message));
  }
  return absl::UnavailableError(absl::StrCat("RPC to worker '", to, "' failed: ", message));
}

}  // namespace

absl::StatusOr<Response> CallFuture::get() {
  if (!future_) return absl::FailedPreconditionError("empty CallFuture");
  future_->wait();
  if (future_->hasError()) return call_error(to_, future_->tryRetrieveErrorMessage());
  try {
    auto message = future_->value().toCustomClass<tdr::Message>();
    Envelope e = decode_envelope(message->payload(), message->tensors().size());
    return Response{std::move(e.body), std::move(message->tensors())};
  } catch (...) {
    return comm::current_exception_status(absl::StatusCode::kDataLoss,
                                          absl::StrCat("malformed reply from worker '", to_, "'"));
  }
}

absl::StatusOr<std::unique_ptr<Agent>> Agent::create(AgentOptions options) {
  if (options.name.empty())
    return absl::InvalidArgumentError("AgentOptions::name is required (e.g. \"trainer0\")");
  if (options.num_worker_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_worker_threads must be at least 1, got ", options.num_worker_threads));
  }
  if (options.timeout.count() <= 0)
    return absl::InvalidArgumentError("AgentOptions::timeout must be positive");
  comm::InitOptions init;
  init.init_method = options.init_method;
  init.rank = options.rank;
  init.world_size = options.world_size;
  init.store = options.store;
  init.timeout = options.timeout;
  absl::StatusOr<comm::RendezvousResult> rv = comm::rendezvous_store(init);
  if (!rv.ok()) return rv.status();
  if (!options.listen_interface.empty())
    ::setenv("TP_SOCKET_IFNAME", options.listen_interface.c_str(), 1);
  comm::ignore_sigpipe();  // a write to a dead peer fails the call instead of killing this process

  std::unique_ptr<Agent> agent(new Agent());
  agent->rank_ = rv->rank;
  agent->world_size_ = rv->world_size;
  agent->in_flight_ = std::make_shared<InFlight>();
  // The shutdown barrier runs over RPC itself, not over the rendezvous store: a store that a
  // stray client wedges (or that stops with rank 0's host) cannot hold the job's end.
  agent->arrivals_ = std::make_shared<Arrivals>();
  if (!options.handlers) options.handlers = std::make_shared<Handlers>();
  options.handlers->add(arrived_handler(options.name), [arrivals = agent->arrivals_](Request& req) {
    const int64_t phase = req.body.i64(), rank = req.body.i64();
    req.body.expect_done();
    if (phase == 0 || phase == 1) {
      std::lock_guard<std::mutex> lock(arrivals->mu);
      arrivals->ranks[phase].insert(rank);
    }
    arrivals->cv.notify_all();
    return Reply{};
  });
  try {
    auto store = c10::make_intrusive<c10d::PrefixStore>("dtrain/rpc", rv->store);
    // uv (TCP) and the basic channel: no shared memory or ptrace permissions needed.
    tdr::TensorPipeRpcBackendOptions opts(
        options.num_worker_threads, std::vector<std::string>{"uv"},
        std::vector<std::string>{"basic"}, static_cast<float>(options.timeout.count()) / 1000.0f,
        "env://");
    agent->agent_ = std::make_shared<tdr::TensorPipeAgent>(
        store, options.name, rv->rank, rv->world_size, opts,
        std::unordered_map<std::string, tdr::DeviceMap>{}, std::vector<c10::Device>{},
        std::make_unique<Callback>(options.handlers, options.name));
    agent->agent_->start();
  } catch (...) {
    return comm::current_exception_status(
        absl::StatusCode::kInternal,
        absl::StrCat("RPC agent '", options.name, "' could not start"));
  }
  agent->options_ = std::move(options);
  return agent;
}

Agent::~Agent() {
  if (agent_ && !shut_down_) {
    try {
      agent_->shutdown();
    } catch (...) {
    }
  }
}

CallFuture Agent::rpc_async(const std::string& to, const std::string& handler, const Writer& body,
                            std::vector<at::Tensor> tensors, std::chrono::milliseconds timeout) {
  const size_t n = tensors.size();
  return send_raw(to, encode_envelope(handler, body, n, options_.name), std::move(tensors),
                  timeout);
}

absl::StatusOr<Response> Agent::rpc_sync(const std::string& to, const std::string& handler,
                                         const Writer& body, std::vector<at::Tensor> tensors,
                                         std::chrono::milliseconds timeout) {
  return rpc_async(to, handler, body, std::move(tensors), timeout).get();
}

CallFuture Agent::send_raw(const std::string& to, std::vector<char> payload,
                           std::vector<at::Tensor> tensors, std::chrono::milliseconds timeout) {
  auto failed = [&](const std::string& why) {
    auto f = c10::make_intrusive<tdr::JitFuture>(at::AnyType::get());
    f->setError(std::make_exception_ptr(std::runtime_error(why)));
    return CallFuture(to, f);
  };
  if (shut_down_) return failed("this agent is shut down");
  if (!has_worker(to)) return failed(absl::StrCat("no worker named '", to, "' in this job"));
  if (std::string bad = non_cpu_tensor(tensors); !bad.empty()) return failed(bad);
  try {
    auto message = c10::make_intrusive<tdr::Message>(std::move(payload), std::move(tensors),
                                                     tdr::MessageType::SCRIPT_CALL);
    const auto ms = timeout.count() > 0 ? timeout : options_.timeout;
    const float seconds = static_cast<float>(ms.count()) / 1000.0f;
    auto future = agent_->send(agent_->getWorkerInfo(to), std::move(message), seconds);
    {
      std::lock_guard<std::mutex> lock(in_flight_->mu);
      ++in_flight_->calls;
    }
    std::weak_ptr<InFlight> weak = in_flight_;
    future->addCallback([weak](c10::ivalue::Future&) {
      if (auto f = weak.lock()) {
        std::lock_guard<std::mutex> lock(f->mu);
        --f->calls;
        f->cv.notify_all();
      }
    });
    return CallFuture(to, future);
  } catch (...) {
    return failed(comm::current_exception_message());
  }
}

absl::Status Agent::shutdown() {
  if (shut_down_) return absl::OkStatus();
  try {
    // Drain: this worker's calls are answered (or failed) ...
    {
      std::unique_lock<std::mutex> lock(in_flight_->mu);
      in_flight_->cv.wait(lock, [&] { return in_flight_->calls == 0; });
    }
    // ... then every worker's: nobody stops serving while a peer may still call it. Each worker
    // tells every other one it has arrived and waits for their replies (so every peer has heard
    // it), then waits until every peer's arrival reached it: after that no peer calls again.
    if (absl::Status s = barrier_over_rpc(); !s.ok()) return s;
    agent_->shutdown();
  } catch (...) {
    return comm::current_exception_status(absl::StatusCode::kUnavailable,
                                          absl::StrCat("RPC shutdown of '", name(), "'"));
  }
  shut_down_ = true;
  return absl::OkStatus();
}

// Two phases. 0, "arrived": told to every peer, every reply awaited, every peer's heard. 1,
// "leaving": the same, but a failed reply is fine -- a peer shuts down only once it heard every
// worker's "leaving", this one's included, so its reply may be cut off by its own shutdown. No
// worker leaves phase 1 before every worker finished phase 0, so no phase-0 reply is cut off.
absl::Status Agent::barrier_over_rpc() {
  const auto deadline =
      std::chrono::steady_clock::now() + options_.timeout + std::chrono::seconds(60);
  for (int64_t phase : {0, 1}) {
    std::vector<CallFuture> told;
    for (const std::string& peer : worker_names()) {
      if (peer == name()) continue;
      told.push_back(rpc_async(peer, arrived_handler(peer), Writer().i64(phase).i64(rank_), {},
                               options_.timeout));
    }
    for (CallFuture& f : told) {
      absl::StatusOr<Response> r = f.get();
      if (!r.ok() && phase == 0) {
        return absl::Status(r.status().code(),
                            absl::StrCat("RPC shutdown of '", name(), "': telling worker '", f.to(),
                                         "' it arrived failed: ", r.status().message()));
      }
    }
    std::unique_lock<std::mutex> lock(arrivals_->mu);
    const std::set<int64_t>& heard = arrivals_->ranks[phase];
    if (!arrivals_->cv.wait_until(
            lock, deadline, [&] { return static_cast<int>(heard.size()) >= world_size_ - 1; })) {
      std::vector<std::string> missing;
      for (int r = 0; r < world_size_; ++r) {
        if (r != rank_ && heard.count(r) == 0) missing.push_back(absl::StrCat(r));
      }
      return absl::DeadlineExceededError(
          absl::StrCat("RPC shutdown of '", name(), "': rank(s) ", absl::StrJoin(missing, ", "),
                       " did not reach the shutdown barrier in time; are they still running?"));
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> Agent::worker_names() const {
  std::vector<std::string> names;
  for (const auto& w : agent_->getWorkerInfos()) names.push_back(w.name_);
  return names;
}

bool Agent::has_worker(const std::string& name) const {
  for (const auto& w : agent_->getWorkerInfos()) {
    if (w.name_ == name) return true;
  }
  return false;
}

}  // namespace dtrain::rpc
