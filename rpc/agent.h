// An RPC agent on LibTorch's TensorPipeAgent (the engine under torch.distributed.rpc) with
// dtrain's own request handling: calls go to C++ handlers registered by name, carrying a typed,
// versioned body (rpc/codec.h) plus tensors. No code or pickled object ever travels.
//
//   auto handlers = std::make_shared<dtrain::rpc::Handlers>();
//   handlers->add("echo", [](dtrain::rpc::Request& r) {
//     return dtrain::rpc::Reply{dtrain::rpc::Writer().str(r.body.str()), r.tensors};
//   });
//   dtrain::rpc::AgentOptions o;
//   o.name = "worker0";                    // rank and world size from RANK / WORLD_SIZE
//   o.handlers = handlers;
//   auto agent = dtrain::rpc::Agent::create(o);              // collective: every worker
//   absl::StatusOr<dtrain::rpc::Response> r =
//       (*agent)->rpc_sync("worker1", "echo", dtrain::rpc::Writer().str("hi"));
//   (*agent)->shutdown();                                     // collective, drains calls
//
// Handlers run on the agent's worker threads (AgentOptions::num_worker_threads), concurrently:
// they must be thread-safe. An exception in a handler, a malformed message or an unknown handler
// becomes an error reply; the caller's Status names the remote worker and its message.
// dtrain's own messages (parameters, gradients, optimizers) are in rpc/internal/protocol.h.
// Creating an agent ignores SIGPIPE (comm::ignore_sigpipe), so a dead peer is an error, not a dead caller.
#ifndef DTRAIN_RPC_AGENT_H_
#define DTRAIN_RPC_AGENT_H_

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/statusor.h"
#include "rpc/codec.h"

namespace torch::distributed::rpc {
class TensorPipeAgent;
}

namespace dtrain::rpc {

struct Request {
  std::string caller;  // the calling worker's name, as its agent states it (empty for send_raw's)
  std::string handler;
  Reader body;
  std::vector<at::Tensor> tensors;
};

struct Reply {
  Writer body;
  std::vector<at::Tensor> tensors;
};

struct Response {
  Reader body;
  std::vector<at::Tensor> tensors;
};

using Handler = std::function<Reply(Request&)>;

// Name -> handler. Thread-safe; handlers may be added while the agent serves. Names starting with
// "dtrain.rpc." are the agent's own (its shutdown barrier).
class Handlers {
 public:
  void add(const std::string& name, Handler handler);
  // nullptr when unknown.
  std::shared_ptr<const Handler> find(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  mutable std::shared_mutex mu_;
  std::map<std::string, std::shared_ptr<const Handler>> handlers_;
};

struct AgentOptions {
  std::string name;                       // this worker's name, unique in the job (required)
  int rank = -1;                          // -1: RANK
  int world_size = -1;                    // -1: WORLD_SIZE
  std::string init_method = "env://";     // as comm::init_process_group: env://, tcp://, file://
  c10::intrusive_ptr<c10d::Store> store;  // instead of init_method (e.g. an in-process HashStore)
  int num_worker_threads = 16;            // handlers that can run at once
  std::chrono::milliseconds timeout = std::chrono::seconds(60);  // default per call
  // Network interface TensorPipe listens on (TP_SOCKET_IFNAME). Loopback unless set; one value
  // per process (TensorPipe reads it once).
  std::string listen_interface = "lo";
  std::shared_ptr<Handlers> handlers;  // may be null: this worker only calls out
};

// A call in flight. get() waits: the reply, or an error naming the remote worker (Unavailable
// for a failed call or an unreachable/dead worker, DeadlineExceeded for a timeout, Internal for
// the remote handler's exception).
class CallFuture {
 public:
  CallFuture(std::string to, c10::intrusive_ptr<c10::ivalue::Future> future)
      : to_(std::move(to)), future_(std::move(future)) {}
  absl::StatusOr<Response> get();
  const std::string& to() const { return to_; }

 private:
  std::string to_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class Agent {
 public:
  // Collective over the job's workers: rendezvous, exchange names and addresses, start serving.
  // Errors: InvalidArgument (options, duplicate names), the rendezvous' Status, Internal when
  // TensorPipe cannot start.
  static absl::StatusOr<std::unique_ptr<Agent>> create(AgentOptions options);
  ~Agent();  // shuts down without draining if shutdown() was not called

  // Sends `handler(body, tensors)` to worker `to`. timeout 0: AgentOptions::timeout.
  CallFuture rpc_async(const std::string& to, const std::string& handler, const Writer& body,
                       std::vector<at::Tensor> tensors = {},
                       std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  absl::StatusOr<Response> rpc_sync(
      const std::string& to, const std::string& handler, const Writer& body,
      std::vector<at::Tensor> tensors = {},
      std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // For tests of the codec's defences: sends `payload` as it is, unchecked.
  CallFuture send_raw(const std::string& to, std::vector<char> payload,
                      std::vector<at::Tensor> tensors = {},
                      std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

  // Collective: waits until no worker has calls in flight, then stops serving. The barrier runs
  // over RPC (not the rendezvous store, which may be wedged or gone by then); DeadlineExceeded
  // naming the ranks that did not arrive within AgentOptions::timeout + 60 s.
  absl::Status shutdown();

  const std::string& name() const { return options_.name; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  std::vector<std::string> worker_names() const;
  bool has_worker(const std::string& name) const;

 private:
  Agent() = default;
  AgentOptions options_;
  int rank_ = 0, world_size_ = 0;
  std::shared_ptr<torch::distributed::rpc::TensorPipeAgent> agent_;
  // shutdown()'s barrier: tell every peer, hear from every peer.
  absl::Status barrier_over_rpc();
  struct Arrivals;
  std::shared_ptr<Arrivals> arrivals_;  // the ranks whose arrival reached this worker
  struct InFlight;
  std::shared_ptr<InFlight> in_flight_;  // calls sent and not yet answered
  bool shut_down_ = false;
};

}  // namespace dtrain::rpc

#endif  // DTRAIN_RPC_AGENT_H_
