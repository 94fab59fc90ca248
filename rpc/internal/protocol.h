// dtrain's RPC protocol: every message the rpc/ package sends, one struct each, holding its
// handler name (kName), its fields, encode() and decode(), and the same for its reply (Result;
// Done when the reply says nothing but success). Callers and handlers go through these structs
// only, so a message's name and layout are written once. Private to rpc/.
//
//   absl::StatusOr<ParamFetch::Result> r = call_sync(agent, "ps1", ParamFetch{id});  // caller
//   serve<ParamFetch>(handlers, [](ParamFetch& m) { return ParamFetch::Result{...}; });  // owner
//
//   FanOut<OptimStep> steps(agent);                    // one request to many workers
//   for (const auto& owner : owners) steps.send(owner, OptimStep{key, context});
//   absl::Status s = steps.wait();                     // every call answered; the first error
//
// Decoders never throw and never trust a length (codec.h's bounded readers; every value read,
// nothing left over): a defect is a Status, InvalidArgument for a request, DataLoss for a reply.
// Encoders of values that may not travel (remote() arguments, optimizer options) TORCH_CHECK.
// Thread safety: the structs are values; a FanOut is used from one thread.
#ifndef DTRAIN_RPC_INTERNAL_PROTOCOL_H_
#define DTRAIN_RPC_INTERNAL_PROTOCOL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "optim/functional/optimizer.h"
#include "rpc/agent.h"
#include "rpc/codec.h"

namespace dtrain::rpc::protocol {

// A request as it goes out: its body and the tensors that travel beside it.
struct Encoded {
  Writer body;
  std::vector<at::Tensor> tensors;
};

// The reply of a message that answers nothing but success: no body, no tensors.
struct Done {
  Reply encode() const { return Reply{}; }
  static absl::StatusOr<Done> decode(Response& r);
};

// dtrain.param.create: a new parameter on the receiving worker, a copy of `value` (the one
// tensor; no body). Result: its id there.
struct ParamCreate {
  static constexpr char kName[] = "dtrain.param.create";
  at::Tensor value;
  Encoded encode() const;
  static absl::StatusOr<ParamCreate> decode(Request& r);
  struct Result {
    int64_t id = 0;
    Reply encode() const;
    static absl::StatusOr<Result> decode(Response& r);
  };
};

// dtrain.param.fetch: the current value of parameter `id`. Result: a snapshot of it (one tensor).
struct ParamFetch {
  static constexpr char kName[] = "dtrain.param.fetch";
  int64_t id = 0;
  Encoded encode() const;
  static absl::StatusOr<ParamFetch> decode(Request& r);
  struct Result {
    at::Tensor value;
    Reply encode() const;
    static absl::StatusOr<Result> decode(Response& r);
  };
};

// dtrain.grad.push: grads[i] is added to parameter ids[i]'s gradient under `context` (the
// gradients travel as tensors, one per id).
struct GradPush {
  static constexpr char kName[] = "dtrain.grad.push";
  int64_t context = 0;
  std::vector<int64_t> ids;
  std::vector<at::Tensor> grads;
  Encoded encode() const;
  static absl::StatusOr<GradPush> decode(Request& r);
  using Result = Done;
};

// dtrain.grad.release: the receiving owner drops `context`'s gradients and refuses it from then on.
struct GradRelease {
  static constexpr char kName[] = "dtrain.grad.release";
  int64_t context = 0;
  Encoded encode() const;
  static absl::StatusOr<GradRelease> decode(Request& r);
  using Result = Done;
};

// dtrain.fn.remote: runs the function registered as `fn` (rpc/functions.h) on `args` and keeps
// the result. Result: its id there. encode() TORCH_CHECKs an argument that cannot travel.
struct FnRemote {
  static constexpr char kName[] = "dtrain.fn.remote";
  std::string fn;
  std::vector<c10::IValue> args;
  Encoded encode() const;
  static absl::StatusOr<FnRemote> decode(Request& r);
  using Result = ParamCreate::Result;
};

// dtrain.optim.create: a local optimizer named `key`, built from the registered `optimizer`
// with `options` over the receiver's parameters `ids`. encode() TORCH_CHECKs an option that
// cannot travel (see write_options).
struct OptimCreate {
  static constexpr char kName[] = "dtrain.optim.create";
  std::string key;
  std::string optimizer;
  optim::OptionsDict options = optim::new_options_dict();
  std::vector<int64_t> ids;
  Encoded encode() const;
  static absl::StatusOr<OptimCreate> decode(Request& r);
  using Result = Done;
};

// dtrain.optim.step: the optimizer `key` steps with the gradients of `context`. Result: whether
// the receiver knew the context (had gradients under it).
struct OptimStep {
  static constexpr char kName[] = "dtrain.optim.step";
  std::string key;
  int64_t context = 0;
  Encoded encode() const;
  static absl::StatusOr<OptimStep> decode(Request& r);
  struct Result {
    bool stepped = false;
    Reply encode() const;
    static absl::StatusOr<Result> decode(Response& r);
  };
};

// dtrain.optim.destroy: the optimizer `key` is dropped (nothing when there is none).
struct OptimDestroy {
  static constexpr char kName[] = "dtrain.optim.destroy";
  std::string key;
  Encoded encode() const;
  static absl::StatusOr<OptimDestroy> decode(Request& r);
  using Result = Done;
};

// Optimizer options (doubles, integers, booleans, strings, pairs of doubles) on the wire; None
// values are left out (the factory's defaults apply). write_options TORCH_CHECKs a value of
// another type; read_options throws CodecError on any defect (at most 1024 options).
void write_options(Writer& w, const optim::OptionsDict& options);
optim::OptionsDict read_options(Reader& r);

// Sends `request` to worker `to`, not waited for.
template <typename M>
CallFuture send(Agent& agent, const std::string& to, const M& request) {
  Encoded e = request.encode();
  return agent.rpc_async(to, M::kName, e.body, std::move(e.tensors));
}

// Waits for `call` (a request M) and decodes its reply: the call's error, or DataLoss naming
// the message and the worker for a malformed reply.
template <typename M>
absl::StatusOr<typename M::Result> result_of(CallFuture& call) {
  absl::StatusOr<Response> r = call.get();
  if (!r.ok()) return r.status();
  absl::StatusOr<typename M::Result> result = M::Result::decode(*r);
  if (!result.ok()) {
    return absl::DataLossError(absl::StrCat("malformed ", M::kName, " reply from '", call.to(),
                                            "': ", result.status().message()));
  }
  return result;
}

template <typename M>
absl::StatusOr<typename M::Result> call_sync(Agent& agent, const std::string& to,
                                             const M& request) {
  CallFuture call = send(agent, to, request);
  return result_of<M>(call);
}

// Registers `fn` (M::Result(M& request)) as M's handler. A request that does not decode is an
// error reply saying what was wrong; so is an exception from `fn` (as for any handler).
template <typename M, typename Fn>
void serve(Handlers& handlers, Fn fn) {
  handlers.add(M::kName, [fn = std::move(fn)](Request& r) -> Reply {
    absl::StatusOr<M> request = M::decode(r);
    if (!request.ok()) throw CodecError(std::string(request.status().message()));
    return fn(*request).encode();
  });
}

// Requests M to several workers, answered together: wait() returns once every call is answered
// (or failed), also after an error, and returns the first error in sending order, so no call is
// left running behind an early return.
template <typename M>
class FanOut {
 public:
  // Prefixes an error's message, given the worker that failed; the agent's message names the
  // worker already.
  using Context = std::function<std::string(const std::string& worker)>;
  using OnResult = std::function<void(const std::string& worker, typename M::Result& result)>;

  explicit FanOut(Agent& agent) : agent_(agent) {}
  void send(const std::string& to, const M& request) {
    calls_.push_back(protocol::send(agent_, to, request));
  }
  // A call of M sent already (e.g. GradientContext::send_async).
  void add(CallFuture call) { calls_.push_back(std::move(call)); }

  // Waits for every call sent so far. on_result, when given, sees each decoded reply.
  absl::Status wait(const Context& context = nullptr, const OnResult& on_result = nullptr) {
    std::vector<CallFuture> calls;
    calls.swap(calls_);
    absl::Status first;
    for (CallFuture& c : calls) {
      absl::StatusOr<typename M::Result> r = result_of<M>(c);
      if (r.ok()) {
        if (on_result) on_result(c.to(), *r);
      } else if (first.ok()) {
        first = context ? absl::Status(r.status().code(),
                                       absl::StrCat(context(c.to()), r.status().message()))
                        : r.status();
      }
    }
    return first;
  }

 private:
  Agent& agent_;
  std::vector<CallFuture> calls_;
};

}  // namespace dtrain::rpc::protocol

#endif  // DTRAIN_RPC_INTERNAL_PROTOCOL_H_
