#include "optim/zero/zero_redundancy_optimizer.h"

#include <map>
#include <random>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/consolidation.h"
#include "comm/agreement.h"
#include "comm/object_collectives.h"
#include "comm/rendezvous_checks.h"
#include "optim/functional/registry.h"
#include "optim/functional/state_checks.h"
#include "optim/functional/state_precision.h"
#include "optim/functional/torch_state.h"
#include "optim/functional/torch_twins.h"
#include "optim/zero/internal/layout.h"
#include "optim/zero/internal/state.h"

namespace dtrain::optim {
namespace {

// Whether the defaults or a group's own options ask for 8-bit optimizer state.
bool asks_8bit_state(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                     const torch::optim::OptimizerOptions* defaults) {
  auto eight_bit = [](const torch::optim::OptimizerOptions* o) {
    const auto* dict = dynamic_cast<const DictOptions*>(o);
    if (dict == nullptr || !dict->dict().contains(kStateDtypeKey)) return false;
    const c10::IValue v = dict->dict().at(kStateDtypeKey);
    return v.isString() && v.toStringRef() == kState8Bit;
  };
  if (eight_bit(defaults)) return true;
  for (const auto& g : groups) {
    if (g.has_options() && eight_bit(&g.options())) return true;
  }
  return false;
}

std::string type_name(const at::Tensor& t) {
  if (t.is_sparse()) return "sparse " + std::string(c10::toString(t.scalar_type())) + " tensor";
  return absl::StrCat(c10::toString(t.scalar_type()), " ", t.device().str(), " tensor");
}

// overlap_with_ddp steps through a functional optimizer: a torch::optim local optimizer with a
// functional twin becomes that twin, with the same options (PyTorch converts likewise). Any other
// stays, and is refused by init().
LocalOptimizer& functional_for_overlap(LocalOptimizer& local, bool overlap) {
  if (!overlap || local.defaults == nullptr) return local;
  if (const TorchTwin* twin = twin_of(*local.defaults)) {
    local = local_optimizer<FunctionalOptimizerAdapter>(twin->name,
                                                        twin->options_to_dict(*local.defaults));
  }
  return local;
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(
    std::vector<torch::optim::OptimizerParamGroup> param_groups, LocalOptimizer local,
    ZeroOptions options)
    : torch::optim::Optimizer(
          std::vector<torch::optim::OptimizerParamGroup>{},
          functional_for_overlap(local, options.overlap_with_ddp || options.shard_gradients)
                  .defaults
              ? local.defaults->clone()
              : nullptr),
      local_factory_(std::move(local)),
      options_(std::move(options)) {
  init(std::move(param_groups));
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params,
                                                 LocalOptimizer local, ZeroOptions options)
    : ZeroRedundancyOptimizer(
          std::vector<torch::optim::OptimizerParamGroup>{
              torch::optim::OptimizerParamGroup(std::move(params))},
          std::move(local), std::move(options)) {}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::init(std::vector<torch::optim::OptimizerParamGroup> param_groups) {
  TORCH_CHECK(local_factory_.make != nullptr && defaults_ != nullptr,
              "ZeroRedundancyOptimizer needs a local optimizer: pass "
              "local_optimizer<torch::optim::Adam>(options) "
              "or local_optimizer<FunctionalOptimizerAdapter>(name, options)");
  TORCH_CHECK(
      options_.group.is_member(),
      "ZeroRedundancyOptimizer: ZeroOptions::group is not set or this rank is not a member of it");
  size_t total = 0;
  for (const auto& g : param_groups) total += g.params().size();
  TORCH_CHECK(total > 0, "ZeroRedundancyOptimizer got an empty parameter list");
  if (options_.overlap_with_ddp || options_.shard_gradients) {
    // A group's own torch::optim options follow its optimizer to the functional twin.
    for (auto& g : param_groups) {
      const TorchTwin* twin = g.has_options() ? twin_of(g.options()) : nullptr;
      if (twin != nullptr)
        g.set_options(std::make_unique<DictOptions>(twin->options_to_dict(g.options())));
    }
  }
  for (const auto& g : param_groups) torch::optim::Optimizer::add_param_group(g);
  validate_params();
  check_zero_options(options_, param_groups_.size());
  const bool element_ranges =
      options_.strategy == PartitionStrategy::kFlat || options_.shard_gradients;
  TORCH_CHECK(!element_ranges || !FunctionalRegistry::global().needs_whole_parameters(
                                     local_factory_.functional_name),
              "ZeroRedundancyOptimizer: ", local_factory_.functional_name,
              " updates each parameter whole, in its "
              "shape, but ",
              options_.shard_gradients ? "shard_gradients" : "partition_strategy=kFlat",
              " cuts parameters into element ranges, which would change its math; use "
              "PartitionStrategy::kSortedGreedy (whole parameters per rank, PyTorch's) without "
              "shard_gradients");
  // 8-bit state (state_precision.h) is quantised in blocks of 256 elements of each parameter: a
  // partition into element ranges would cut blocks at the shard edges.
  TORCH_CHECK(!element_ranges || !asks_8bit_state(param_groups_, defaults_.get()),
              "ZeroRedundancyOptimizer: state_dtype='8bit' keeps blocks of ", kQuantBlock,
              " elements of each parameter, but ",
              options_.shard_gradients ? "shard_gradients" : "partition_strategy=kFlat",
              " cuts parameters into element ranges; use PartitionStrategy::kSortedGreedy "
              "without shard_gradients, or state_dtype='bfloat16' (elementwise)");
  // One name per instance for control-plane keys (rank 0's), and a check that every rank built
  // the same optimizer: mismatched settings would otherwise pair unrelated collectives.
  std::string fingerprint =
      absl::StrCat(zero_options_fingerprint(options_), " groups=", param_groups_.size(), " sizes=");
  for (const auto& g : param_groups_) {
    for (const auto& p : g.params()) absl::StrAppend(&fingerprint, p.numel(), ",");
    absl::StrAppend(&fingerprint, ";");
  }
  const absl::Status same = comm::check_identical(options_.group, {fingerprint}, "fingerprint");
  TORCH_CHECK(!absl::IsInvalidArgument(same),
              "ZeroRedundancyOptimizer was built differently on different ranks (", same.message(),
              "); every rank must pass the same parameters and options");
  TORCH_CHECK(same.ok(), "ZeroRedundancyOptimizer construction is a collective: ", same.ToString());
  c10::IValue id(absl::StrFormat("zero/%08x%08x", std::random_device{}(), std::random_device{}()));
  const absl::Status shared =
      comm::broadcast_object(options_.group, id, 0);  // rank 0's name for this instance
  TORCH_CHECK(shared.ok(),
              "ZeroRedundancyOptimizer construction is a collective: ", shared.ToString());
  store_prefix_ = id.toStringRef();
  build_layout();
  build_local_optimizer();
  TORCH_CHECK(!(options_.overlap_with_ddp || options_.shard_gradients) ||
                  dynamic_cast<FunctionalOptimizerAdapter*>(local_.get()) != nullptr,
              options_.shard_gradients ? "shard_gradients" : "overlap_with_ddp",
              " steps parameters bucket by "
              "bucket, which needs a functional local optimizer: pass "
              "local_optimizer<FunctionalOptimizerAdapter>(name, "
              "options), or a torch::optim type with a functional twin (SGD, Adam, AdamW, Adagrad, "
              "RMSprop: "
              "converted), not another torch::optim type");
}

void ZeroRedundancyOptimizer::validate_params() const {
  const at::Tensor* first = nullptr;
  for (const auto& g : param_groups_) {
    for (const auto& p : g.params()) {
      TORCH_CHECK(p.defined(), "ZeroRedundancyOptimizer got an undefined parameter");
      if (first == nullptr) {
        TORCH_CHECK(!p.is_sparse(),
                    "ZeroRedundancyOptimizer only supports using the same dense type for all "
                    "parameters but got ",
                    type_name(p));
        first = &p;
        continue;
      }
      TORCH_CHECK(!p.is_sparse() && p.scalar_type() == first->scalar_type() &&
                      p.device() == first->device(),
                  "ZeroRedundancyOptimizer only supports using the same dense type for all "
                  "parameters but got both ",
                  type_name(*first), " and ", type_name(p));
    }
  }
}

void ZeroRedundancyOptimizer::build_layout() {
  std::vector<std::vector<at::Tensor>> groups;
  for (const auto& g : param_groups_) groups.push_back(g.params());
  if (!grad_shard_buckets_.empty()) {
    layout_ = std::make_unique<internal::GradShardLayout>(
        groups, options_.group, grad_shard_buckets_, options_.flat_alignment);
  } else if (options_.strategy == PartitionStrategy::kFlat) {
    layout_ =
        std::make_unique<internal::FlatLayout>(groups, options_.group, options_.flat_alignment);
  } else {
    layout_ = std::make_unique<internal::WholeParamLayout>(
        groups, options_.group, options_.params_per_rank, options_.parameters_as_bucket_view,
        options_.overlap_chunk_bytes);
  }
}

void ZeroRedundancyOptimizer::build_local_optimizer() {
  std::vector<torch::optim::OptimizerParamGroup> local_groups;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    local_groups.emplace_back(layout_->local_tensors(g), param_groups_[g].options().clone());
  }
  local_ = local_factory_.make(std::move(local_groups));
}

void ZeroRedundancyOptimizer::sync_options(bool to_local) {
  auto& local_groups = local_->param_groups();
  TORCH_CHECK(local_groups.size() == param_groups_.size(),
              "ZeroRedundancyOptimizer: the local optimizer has ", local_groups.size(),
              " groups, the wrapper ", param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    if (to_local) {
      local_groups[g].set_options(param_groups_[g].options().clone());
    } else {
      param_groups_[g].set_options(local_groups[g].options().clone());
    }
  }
}

void ZeroRedundancyOptimizer::check_add_param_group_agreement(bool calling) {
  // How long a failed step asks the store whether another rank's add_param_group caused it.
  constexpr std::chrono::milliseconds kFailedStepStoreDeadline{5000};
  c10d::Store& store = *options_.group.store();
  const std::string key = absl::StrCat(store_prefix_, "/add_param_group/", add_param_group_calls_);
  const std::string how = absl::StrCat("add_param_group must be called on all ranks: ");
  if (!calling) {
    // After a failed step: has another rank started an add_param_group this rank never made?
    // (A store that fails too leaves the step's own error to propagate.) Bounded by our own
    // deadline: c10d's store client reads the reply with no timeout, and a store whose link was
    // cut never answers, which would hold the step's error for TCP's ~15 minutes.
    c10::intrusive_ptr<c10d::Store> shared = options_.group.store();
    const auto bound =
        std::min<std::chrono::milliseconds>(options_.group.timeout(), kFailedStepStoreDeadline);
    absl::StatusOr<bool> asked = comm::run_with_deadline<bool>(
        [shared, key]() -> absl::StatusOr<bool> { return shared->check({key}); },
        std::chrono::steady_clock::now() + bound, "the store's add_param_group count");
    const bool other_called = asked.ok() && *asked;
    TORCH_CHECK(!other_called, how, "another rank called it (call #", add_param_group_calls_ + 1,
                ") but rank ", rank(), " went on to step()");
    return;
  }
  const int64_t arrived = store.add(key, 1);
  if (arrived == world_size()) store.set(key + "/all", std::vector<uint8_t>{1});
  try {
    store.wait({key + "/all"}, options_.group.timeout());
  } catch (const std::exception&) {
    const int64_t now = store.add(key, 0);
    TORCH_CHECK(false, how, "only ", now, " of ", world_size(), " ranks called it (call #",
                add_param_group_calls_ + 1, ") within the group timeout of ",
                options_.group.timeout().count(), " ms");
  }
  ++add_param_group_calls_;
}

void ZeroRedundancyOptimizer::add_param_group(
    const torch::optim::OptimizerParamGroup& param_group) {
  // Every rank has the same strategy (checked at construction), so all fail alike here.
  layout_->check_can_add_group();
  check_add_param_group_agreement(/*calling=*/true);
  TORCH_CHECK(!options_.overlap_with_ddp,
              "add_param_group: overlap_with_ddp supports a single parameter group, "
              "created with the optimizer");
  TORCH_CHECK(options_.params_per_rank.empty(),
              "add_param_group: this ZeroRedundancyOptimizer uses a manual params_per_rank, which "
              "supports a single "
              "parameter group");
  torch::optim::Optimizer::add_param_group(param_group);
  validate_params();
  layout_->add_group(param_groups_.back().params());
  local_->add_param_group(torch::optim::OptimizerParamGroup(
      layout_->local_tensors(param_groups_.size() - 1), param_groups_.back().options().clone()));
  consolidated_ = c10::IValue();
}

at::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  // Inside a Join context: tell it this rank still has inputs (no-op otherwise).
  if (!in_join_hook_) comm::Join::notify_join_context(*this);
  // No store traffic on the hot path: only a step that fails asks the store whether the cause is
  // another rank's add_param_group (then that is the error), else the failure propagates as is.
  try {
    return step_unchecked(std::move(closure));
  } catch (const std::exception&) {
    check_add_param_group_agreement(/*calling=*/false);
    throw;
  }
}

at::Tensor ZeroRedundancyOptimizer::step_unchecked(LossClosure closure) {
  // overlap_with_ddp: the DDP hook already stepped and synchronised every parameter in backward.
  // A closure is not evaluated (it would run forward and backward again, and a backward inside it
  // would step the parameters a second time), as PyTorch, which warns and returns None.
  if (options_.overlap_with_ddp) {
    if (closure != nullptr) {
      TORCH_WARN(
          "ZeroRedundancyOptimizer: step(closure) should not be in the training loop when "
          "overlap_with_ddp "
          "is true: the DDP hook already stepped the parameters during backward; the closure was "
          "not "
          "evaluated");
    }
    return at::Tensor();
  }
  TORCH_CHECK(!options_.shard_gradients || !grad_shard_buckets_.empty(),
              "ZeroRedundancyOptimizer with "
              "shard_gradients steps the gradient slices DDP's ZeRO-2 hook reduces: register it "
              "before the first "
              "step, ddp.register_comm_hook(dtrain::ddp_hooks::hook_with_zero2(ddp, zero))");
  stepped_ = true;
  sync_options(/*to_local=*/true);
  at::Tensor loss = layout_->step_and_sync(*local_, std::move(closure));
  sync_options(/*to_local=*/false);
  stale_consolidation_ = stale_consolidation_ || !consolidated_.isNone();
  consolidated_ = c10::IValue();
  return loss;
}

c10::IValue ZeroRedundancyOptimizer::synced_local_state_dict() {
  sync_options(/*to_local=*/true);
  return optimizer_state_dict(*local_);
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  absl::StatusOr<c10::IValue> full = checkpoint::consolidate_state_dict(
      options_.group, layout_->consolidation_part(synced_local_state_dict()), to);
  TORCH_CHECK(full.ok(), "consolidate_state_dict: ", full.status().ToString());
  consolidated_ = full->isNone() ? *full : layout_->assemble_consolidated(*full);
  stale_consolidation_ = false;
}

c10::IValue ZeroRedundancyOptimizer::state_dict() const {
  TORCH_CHECK(!stale_consolidation_,
              "ZeroRedundancyOptimizer: the consolidated state on this rank is stale: step() "
              "ran after consolidate_state_dict; call consolidate_state_dict(to=",
              rank(),
              ") on all ranks again "
              "before state_dict()");
  TORCH_CHECK(!consolidated_.isNone(),
              "Optimizer state has not been consolidated on this rank. Please call "
              "`consolidate_state_dict(to=",
              rank(), ")` on all ranks beforehand if you meant to save the global state.");
  return consolidated_;
}

void ZeroRedundancyOptimizer::load_state_dict(const c10::IValue& state_dict) {
  const std::string what = "ZeroRedundancyOptimizer.load_state_dict";
  TORCH_CHECK(state_dict.isGenericDict(), what, ": expected a dict, got ", state_dict.tagKind());
  absl::StatusOr<checkpoint::OptimizerStateDict> sd =
      checkpoint::parse_optimizer_state_dict(state_dict, what + ": the state dict");
  TORCH_CHECK(sd.ok(), sd.status().message(), "; ", kLoadAdvice);
  const auto count = static_cast<int64_t>(layout_->params().size());
  for (const auto& [index, entry] : sd->state) {
    TORCH_CHECK(index >= 0 && index < count, what,
                ": the state dict has state for parameter index ", index,
                " but this optimizer has ", count, " parameters (indices 0..", count - 1,
                "): it was saved for "
                "another model or another parameter order");
  }
  // Every entry against every parameter, on every rank, before this rank's part is cut out.
  auto* adapter = dynamic_cast<FunctionalOptimizerAdapter*>(local_.get());
  const internal::EntryCheck check = [&](size_t group, const checkpoint::StateEntry& entry,
                                         const at::Tensor& param, int64_t file_index,
                                         const OptionsDict& options) {
    if (adapter != nullptr && group < adapter->param_groups().size()) {
      return adapter->functional(group).check_state_entry(entry, param, file_index, options, group);
    }
    return check_generic_entry(entry, param, file_index, what);
  };
  absl::StatusOr<internal::CheckedGlobal> global =
      internal::checked_global_state(*sd, layout_->params(), layout_->group_counts(), check, what);
  TORCH_CHECK(global.ok(), global.status().message());
  const std::vector<internal::LocalEntry>& entries = layout_->entries();
  std::vector<int64_t> file_index;
  for (const internal::LocalEntry& e : entries) {
    file_index.push_back(global->file_index[static_cast<size_t>(e.param)]);
  }
  load_local_state(global->groups,
                   internal::local_state_from_global(global->state, entries, layout_->params()),
                   file_index);
}

void ZeroRedundancyOptimizer::load_local_state(
    const std::vector<checkpoint::ParamGroup>& groups,
    std::map<int64_t, checkpoint::StateEntry> local_state, const std::vector<int64_t>& file_index) {
  checkpoint::OptimizerStateDict local;
  local.param_groups =
      internal::local_param_groups(groups, layout_->entries(), layout_->group_counts());
  local.state = std::move(local_state);
  if (auto* adapter = dynamic_cast<FunctionalOptimizerAdapter*>(local_.get())) {
    adapter->load_state_dict(checkpoint::to_ivalue(local), file_index);
  } else {
    // A LibTorch optimizer: what is known of any optimizer's state, checked here.
    const std::string what = "ZeroRedundancyOptimizer.load_state_dict";
    std::vector<at::Tensor> local_params;
    for (const auto& g : local_->param_groups()) {
      local_params.insert(local_params.end(), g.params().begin(), g.params().end());
    }
    for (size_t g = 0; g < local.param_groups.size(); ++g) {
      absl::Status numbers = check_option_numbers(local.param_groups[g], g, what);
      TORCH_CHECK(numbers.ok(), numbers.message());
    }
    for (const auto& [k, entry] : local.state) {
      const auto i = static_cast<size_t>(k);
      TORCH_CHECK(i < local_params.size() && i < file_index.size(), what, ": local state ", k,
                  " is beyond this rank's ", local_params.size(), " parameters");
      absl::Status ok = check_generic_entry(entry, local_params[i], file_index[i], what);
      TORCH_CHECK(ok.ok(), ok.message());
    }
    load_optimizer_state_dict(*local_, checkpoint::to_ivalue(local));
  }
  state_loaded_ = true;
  sync_options(/*to_local=*/false);
  consolidated_ = c10::IValue();
  stale_consolidation_ = false;
}

class ZeroRedundancyOptimizer::JoinStep : public comm::JoinHook {
 public:
  explicit JoinStep(ZeroRedundancyOptimizer* zero) : zero_(zero) {}
  // Shadows one step of the ranks still training: update and broadcast this rank's shard.
  void main_hook() override {
    zero_->in_join_hook_ = true;
    try {
      zero_->step();
    } catch (...) {
      zero_->in_join_hook_ = false;
      throw;
    }
    zero_->in_join_hook_ = false;
  }

 private:
  ZeroRedundancyOptimizer* zero_;
};

std::unique_ptr<comm::JoinHook> ZeroRedundancyOptimizer::join_hook(const comm::JoinOptions&) {
  TORCH_CHECK(!options_.overlap_with_ddp,
              "ZeroRedundancyOptimizer with overlap_with_ddp cannot join: its steps run "
              "in the DDP hook, which a joined rank would run with zero gradients; give every rank "
              "the same number "
              "of inputs, or build it without overlap_with_ddp");
  return std::make_unique<JoinStep>(this);
}

c10::Device ZeroRedundancyOptimizer::join_device() const {
  return layout_->params().at(0).device();
}

c10::intrusive_ptr<comm::C10dGroup> ZeroRedundancyOptimizer::join_process_group() const {
  return options_.group.pg();
}

int64_t ZeroRedundancyOptimizer::local_state_bytes() {
  return state_tensor_bytes(optimizer_state_dict(*local_));
}

at::Tensor ZeroRedundancyOptimizer::clip_grad_norm_(double max_norm, double norm_type,
                                                    bool error_if_nonfinite) {
  return layout_->clip_grad_norm_(max_norm, norm_type, error_if_nonfinite);
}

int64_t ZeroRedundancyOptimizer::gradient_bytes() const { return layout_->gradient_bytes(); }

const std::vector<at::Tensor>& ZeroRedundancyOptimizer::parameters() const {
  return layout_->params();
}

const partition::ParamPartition& ZeroRedundancyOptimizer::partition() const {
  return layout_->partition();
}

}  // namespace dtrain::optim
