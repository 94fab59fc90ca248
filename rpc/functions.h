// Named functions a worker runs for rpc::remote (PyTorch's rpc.remote(worker, torch.add, args)):
// no code travels, so a function is called by the name it is registered under on every worker,
// with arguments (tensors, numbers, booleans, strings, lists of numbers) carried by the codec.
// The result, a tensor, stays on that worker: rpc::remote returns a RemoteRef to it.
//
//   auto& fns = dtrain::rpc::FunctionRegistry::global();          // built-ins: see global()
//   fns.register_function("my.scale", [](const std::vector<c10::IValue>& a) {
//     return a.at(0).toTensor() * a.at(1).toDouble();
//   });                                                            // on every worker
//   RemoteRef r = *dtrain::rpc::remote(*agent, "worker1", "torch.add", {torch::ones({2}), 3});
//   RemoteRef s = *dtrain::rpc::remote(*agent, "worker1", "my.scale", {torch::ones({2}), 0.5});
//
// Thread safety: registration and calls are safe from any thread (a reader-writer lock taken
// only for the lookup); functions run concurrently on the agent's worker threads and must be
// thread-safe themselves.
#ifndef DTRAIN_RPC_FUNCTIONS_H_
#define DTRAIN_RPC_FUNCTIONS_H_

#include <functional>
#include <map>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include "rpc/codec.h"

namespace dtrain::rpc {

// Takes the call's arguments (Tensor, Double, Int, Bool, String, IntList or DoubleList
// IValues) and returns the value that stays on the worker. Misuse (wrong argument types) is a
// TORCH_CHECK: the caller gets it as an error naming the worker and the function.
using RemoteFunction = std::function<at::Tensor(const std::vector<c10::IValue>& args)>;

class FunctionRegistry {
 public:
  // The process-wide registry with the built-ins, named after PyTorch's functions:
  //   torch.add(tensor, tensor or number[, alpha])   torch.sub(same)   torch.mul(tensor, tensor or number)
  //   torch.matmul(tensor, tensor)                   torch.ones(sizes) torch.zeros(sizes)
  //   torch.full(sizes, number)                      where sizes are ints, or one list of ints
  // (float32 results for the factories, as torch.ones(2) in Python).
  static FunctionRegistry& global();

  // Registers (or replaces) `name`. Register the same functions on every worker that serves them.
  void register_function(const std::string& name, RemoteFunction fn);
  bool contains(const std::string& name) const;
  std::vector<std::string> names() const;
  // Runs `name` (TORCH_CHECK listing the registered names when there is no such function, and
  // when the function returns an undefined tensor).
  at::Tensor call(const std::string& name, const std::vector<c10::IValue>& args) const;

 private:
  mutable std::shared_mutex mu_;
  std::map<std::string, std::shared_ptr<const RemoteFunction>> functions_;
};

// Encodes `args` into `w`, appending their tensors (detached) to `tensors`. TORCH_CHECK on a
// type that cannot travel (say which, and what can).
void write_args(Writer& w, std::vector<at::Tensor>& tensors, const std::vector<c10::IValue>& args);
// Decodes what write_args wrote; every tensor that travelled must be used exactly once.
// Throws CodecError on any defect.
std::vector<c10::IValue> read_args(Reader& r, const std::vector<at::Tensor>& tensors);

}  // namespace dtrain::rpc

#endif  // DTRAIN_RPC_FUNCTIONS_H_
