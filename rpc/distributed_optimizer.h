// The RPC DistributedOptimizer (torch.distributed.optim.DistributedOptimizer): one local
// functional optimizer per owner of the parameters, created there through the registry (so
// built-ins, QHM and your own registered optimizers all work), stepped with the gradients of a
// GradientContext.
//
//   auto opt = dtrain::rpc::DistributedOptimizer::create(*agent, "Adam", adam_options, remote_params);
//   GradientContext ctx(*agent);
//   ... forward/backward locally, ctx.send(remote_params, grads) ...
//   absl::Status s = (*opt)->step(ctx.id());    // every owner steps, in parallel
//
// Concurrency (as PyTorch documents): step() calls from one or several clients are serialised
// per owner; different owners run in parallel; there is no global lock. A step on an owner
// updates only parameters that have a gradient in that context.
#ifndef DTRAIN_RPC_DISTRIBUTED_OPTIMIZER_H_
#define DTRAIN_RPC_DISTRIBUTED_OPTIMIZER_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "optim/functional/registry.h"
#include "rpc/agent.h"
#include "rpc/local_optimizers.h"
#include "rpc/remote.h"

namespace dtrain::rpc {

class DistributedOptimizer {
 public:
  // Creates the local optimizers on every owner in parallel: the functional optimizer registered
  // as `optimizer` (optim/functional/registry.h), or else the LibTorch one registered so with
  // rpc::LocalOptimizerRegistry (TORCH_WARN: stepped through .grad under the owner's lock).
  // Errors name the owner and carry its message (an unknown optimizer name, invalid options, an
  // unknown parameter); optimizers already created on other owners are destroyed again.
  static absl::StatusOr<std::unique_ptr<DistributedOptimizer>> create(
      Agent& agent, const std::string& optimizer, const optim::OptionsDict& options,
      std::vector<RemoteRef> params);
  // From a LibTorch optimizer type and its options: create<torch::optim::Adam>(agent, AdamOptions(1e-3), params).
  // Its functional twin when it has one (optim/functional/registry.h); otherwise the type as registered with
  // rpc::LocalOptimizerRegistry, run as it is on every owner, with a warning (TORCH_WARN) that
  // it is the slower path, as PyTorch warns. InvalidArgument when it is neither.
  template <typename TorchOptimizer, typename Options>
  static absl::StatusOr<std::unique_ptr<DistributedOptimizer>> create(
      Agent& agent, const Options& options, std::vector<RemoteRef> params) {
    const std::string name = optim::FunctionalRegistry::global().name_of<TorchOptimizer>();
    if (!name.empty())
      return create(agent, name, optim::options_from_torch(options), std::move(params));
    std::optional<LocalOptimizerRegistry::TypeEntry> local =
        LocalOptimizerRegistry::global().find<TorchOptimizer>();
    if (!local.has_value()) {
      return absl::InvalidArgumentError(
          std::string("DistributedOptimizer: the LibTorch optimizer type ") +
          typeid(TorchOptimizer).name() +
          " has no functional twin and is not registered with rpc::LocalOptimizerRegistry; "
          "register a functional " +
          "twin (optim/functional/registry.h) or the type itself (rpc/local_optimizers.h) on every "
          "worker");
    }
    return create_local(agent, *local, options, std::move(params));
  }
  ~DistributedOptimizer();  // destroys the remote optimizers (errors ignored)

  // Every owner applies its optimizer to the gradients of `context_id`, in parallel; returns
  // when all are done. The first error, naming its owner, if any failed. NotFound, naming the
  // context, when it was released or is unknown (created neither in this process nor, by its
  // gradients, on any owner), as PyTorch raises; nothing is stepped then. An owner with no
  // gradient under a live context leaves its parameters untouched.
  absl::Status step(int64_t context_id);

  const std::vector<std::string>& owners() const { return owners_; }

 private:
  DistributedOptimizer(Agent& agent, std::string key) : agent_(agent), key_(std::move(key)) {}
  // create() for a type registered with LocalOptimizerRegistry: InvalidArgument when its
  // to_dict refuses `options`.
  static absl::StatusOr<std::unique_ptr<DistributedOptimizer>> create_local(
      Agent& agent, const LocalOptimizerRegistry::TypeEntry& local,
      const torch::optim::OptimizerOptions& options, std::vector<RemoteRef> params);
  Agent& agent_;
  std::string key_;
  std::vector<std::string> owners_;
};

}  // namespace dtrain::rpc

#endif  // DTRAIN_RPC_DISTRIBUTED_OPTIMIZER_H_
