#include "optim/diloco.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "absl/status/status.h"
#include "optim/diloco_compression.h"
#include "optim/functional/registry.h"
#include "optim/functional/torch_state.h"
#include "optim/internal/wrapper_groups.h"
#include "optim/zero/zero_redundancy_optimizer.h"

namespace dtrain::optim {
namespace {

constexpr char kDiLoCoKey[] = "diloco";
constexpr char kOuterWrites[] = "copies the outer step's global parameters";
constexpr char kLoad[] = "DiLoCo.load_state_dict: ";
constexpr char kSameRun[] =
    "; load a state dict that DiLoCo::state_dict() wrote for the same parameters and options";

const torch::optim::Optimizer& checked(const std::unique_ptr<torch::optim::Optimizer>& inner) {
  TORCH_CHECK(inner != nullptr,
              "DiLoCo: the inner optimizer is null; pass the optimizer of the local steps (e.g. "
              "std::make_unique<torch::optim::AdamW>(params, options))");
  return *inner;
}

// The dtype of a parameter's global copy: float32, or float64 for float64 parameters.
at::ScalarType global_dtype(at::ScalarType param) {
  return param == at::kDouble ? at::kDouble : at::kFloat;
}

std::string shape_of(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << sizes;
  return out.str();
}

// Contiguous fragments of about equal element counts: fragment f starts at the first parameter
// whose preceding elements reach f/F of the total, moved so that no fragment is empty.
std::vector<std::vector<int64_t>> split_fragments(const std::vector<at::Tensor>& params,
                                                  int64_t fragments) {
  const auto n = static_cast<int64_t>(params.size());
  std::vector<int64_t> before(params.size() + 1, 0);  // elements before parameter i
  for (size_t i = 0; i < params.size(); ++i) before[i + 1] = before[i] + params[i].numel();
  std::vector<int64_t> start(static_cast<size_t>(fragments) + 1, 0);
  start.back() = n;
  for (int64_t f = 1; f < fragments; ++f) {
    int64_t s = 0;
    while (s < n && before[s] * fragments < f * before[n]) ++s;
    start[f] = std::min(std::max(s, start[f - 1] + 1), n - (fragments - f));
  }
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(fragments));
  for (int64_t f = 0; f < fragments; ++f) {
    for (int64_t i = start[f]; i < start[f + 1]; ++i) out[f].push_back(i);
  }
  return out;
}

// An integer entry of the "diloco" dict, checked to lie in [lo, hi].
int64_t int_entry(const c10::impl::GenericDict& d, const char* key, int64_t lo, int64_t hi,
                  const std::string& meaning) {
  TORCH_CHECK(d.contains(key), kLoad, "the 'diloco' entry has no '", key, "' (", meaning, ")",
              kSameRun);
  const c10::IValue v = d.at(key);
  TORCH_CHECK(v.isInt(), kLoad, "diloco.", key, " is a ", v.tagKind(), ", not an int (", meaning,
              ")", kSameRun);
  const int64_t x = v.toInt();
  TORCH_CHECK(x >= lo && x <= hi, kLoad, "diloco.", key, " is ", x, ", outside [", lo, ", ", hi,
              "] (", meaning, ")", kSameRun);
  return x;
}

// The "diloco" dict's outer_compression ("none" when absent: written before the option) against
// this DiLoCo's.
void check_compression_entry(const c10::impl::GenericDict& d, const std::string& mine) {
  std::string saved = "none";
  if (d.contains("outer_compression")) {
    const c10::IValue v = d.at("outer_compression");
    TORCH_CHECK(v.isString(), kLoad, "diloco.outer_compression is a ", v.tagKind(),
                ", not a string", kSameRun);
    saved = v.toStringRef();
  }
  TORCH_CHECK(saved == mine, kLoad, "diloco.outer_compression is '", saved, "', this DiLoCo's is '",
              mine,
              "'; the outer optimizer's state was built on those outer gradients: resume with "
              "DiLoCoOptions::outer_compression = \"",
              saved, "\"");
}

}  // namespace

OptionsDict default_outer_options() {
  OptionsDict d = new_options_dict();
  d.insert("lr", 0.7);
  d.insert("momentum", 0.9);
  d.insert("nesterov", true);
  return d;
}

void check_diloco_options(const DiLoCoOptions& options, size_t num_params) {
  TORCH_CHECK(options.sync_every >= 1, "DiLoCoOptions::sync_every is ", options.sync_every,
              "; it is H, the inner steps per outer round: set it to 1 or more (the paper uses "
              "500)");
  TORCH_CHECK(options.fragments >= 1, "DiLoCoOptions::fragments is ", options.fragments,
              "; set it to 1 (plain DiLoCo) or more (Streaming DiLoCo)");
  TORCH_CHECK(static_cast<size_t>(options.fragments) <= num_params, "DiLoCoOptions::fragments is ",
              options.fragments, " but there are only ", num_params,
              " parameters; every fragment needs one: set fragments to at most ", num_params);
  TORCH_CHECK(options.sync_every % options.fragments == 0, "DiLoCoOptions::sync_every (",
              options.sync_every, ") is not a multiple of fragments (", options.fragments,
              "): one fragment syncs every sync_every / fragments inner steps; make sync_every a "
              "multiple of fragments");
  check_outer_compression(options.outer_compression);
  TORCH_CHECK(
      options.quorum == nullptr || (options.fragments == 1 && options.fragment_sync_delay == 0 &&
                                    options.outer_compression == "none"),
      "DiLoCoOptions::quorum is set with fragments ", options.fragments, ", fragment_sync_delay ",
      options.fragment_sync_delay, ", outer_compression '", options.outer_compression,
      "'; the fault-tolerant sync supports plain DiLoCo only: set fragments 1, "
      "fragment_sync_delay 0 and outer_compression \"none\", or leave quorum unset");
  TORCH_CHECK(options.max_quorum_retries >= 1, "DiLoCoOptions::max_quorum_retries is ",
              options.max_quorum_retries, "; set it to 1 or more");
  const int64_t interval = options.sync_every / options.fragments;
  TORCH_CHECK(options.fragment_sync_delay >= 0, "DiLoCoOptions::fragment_sync_delay is ",
              options.fragment_sync_delay,
              "; it is tau, the inner steps a fragment's all-reduce runs behind: set it to 0 (the "
              "sync blocks) or more");
  TORCH_CHECK(options.fragment_sync_delay < interval, "DiLoCoOptions::fragment_sync_delay is ",
              options.fragment_sync_delay,
              " but a fragment syncs every sync_every / fragments = ", interval,
              " inner steps, and its all-reduce must be issued within the round it ends: set "
              "fragment_sync_delay to at most ",
              interval - 1, ", or raise sync_every");
  TORCH_CHECK(options.fragment_update_alpha >= 0.0 && options.fragment_update_alpha <= 1.0,
              "DiLoCoOptions::fragment_update_alpha is ", options.fragment_update_alpha,
              "; it mixes a synced fragment's local parameters into the new global ones (0: take "
              "the global ones, 1: keep the local ones): set it in [0, 1]");
  const FunctionalRegistry& registry = FunctionalRegistry::global();
  if (!registry.contains(options.outer_optimizer)) {
    std::string names;
    for (const std::string& n : registry.names()) names += (names.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, "DiLoCoOptions::outer_optimizer '", options.outer_optimizer,
                "' is not a registered functional optimizer; use one of ", names,
                ", or register yours with FunctionalRegistry::global().register_optimizer");
  }
}

DiLoCo::DiLoCo(std::unique_ptr<torch::optim::Optimizer> inner, DiLoCoOptions options)
    : torch::optim::Optimizer(internal::copy_param_groups(checked(inner)),
                              checked(inner).defaults().clone()),
      inner_(std::move(inner)),
      options_(std::move(options)) {
  options_.outer_options = options_.outer_options.copy();
  TORCH_CHECK(options_.quorum == nullptr || !options_.group,
              "DiLoCo: both DiLoCoOptions::group and quorum are set; with quorum every sync "
              "averages over its quorum's own group: leave group unset");
  TORCH_CHECK(
      options_.quorum == nullptr || dynamic_cast<ZeroRedundancyOptimizer*>(inner_.get()) == nullptr,
      "DiLoCo: DiLoCoOptions::quorum with a ZeroRedundancyOptimizer inside is not "
      "supported (a rejoining replica takes a peer's whole state, which ZeRO shards); "
      "use an unsharded inner optimizer with quorum, or leave quorum unset");
  TORCH_CHECK(options_.quorum != nullptr || options_.group.is_member(),
              "DiLoCo: DiLoCoOptions::group is not set or this rank is not in it; pass the group "
              "whose ranks average pseudo-gradients (for all ranks, the world group that "
              "init_process_group returned)");
  const std::vector<at::Tensor> params = local_params();
  TORCH_CHECK(!params.empty(),
              "DiLoCo: the inner optimizer has no parameters; give it the model's parameters "
              "before wrapping it");
  check_diloco_options(options_, params.size());
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor p = params[i].detach();
    TORCH_CHECK(at::isFloatingType(p.scalar_type()), "DiLoCo: parameter ", i, " is ",
                p.scalar_type(),
                "; DiLoCo averages floating-point parameters only: leave it out of the inner "
                "optimizer");
    global_.push_back(
        at::empty(p.sizes(), p.options().dtype(global_dtype(p.scalar_type()))).copy_(p));
  }
  try {
    outer_ = FunctionalRegistry::global().create(options_.outer_optimizer, global_,
                                                 options_.outer_options);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "DiLoCo: the outer optimizer '", options_.outer_optimizer,
                "' refused DiLoCoOptions::outer_options ", c10::IValue(options_.outer_options),
                ": ", e.what_without_backtrace(),
                "; give outer_options that optimizer's own options (the defaults are SGD's)");
  }
  internal::check_no_param_remainders(*inner_, "DiLoCo", kOuterWrites);
  fragments_ = split_fragments(params, options_.fragments);
  // LibTorch's add_param_group may have given this side the defaults instead of options of a type
  // it does not know (the adapter's DictOptions): take the inner optimizer's own.
  sync_options(/*to_inner=*/false);
}

std::vector<at::Tensor> DiLoCo::local_params() const {
  std::vector<at::Tensor> params;
  for (const auto& g : inner_->param_groups()) {
    params.insert(params.end(), g.params().begin(), g.params().end());
  }
  return params;
}

void DiLoCo::sync_options(bool to_inner) {
  auto& inner = inner_->param_groups();
  TORCH_CHECK(inner.size() == param_groups_.size(),
              "DiLoCo: param groups were added after construction (", inner.size(),
              " in the inner optimizer, ", param_groups_.size(),
              " here); DiLoCo keeps global copies of the parameters it was built with: add every "
              "group to the inner optimizer before constructing DiLoCo");
  if (to_inner) {
    internal::copy_group_options(param_groups_, inner);
  } else {
    internal::copy_group_options(inner, param_groups_);
  }
}

at::Tensor DiLoCo::step(LossClosure closure) {
  sync_options(/*to_inner=*/true);  // LR schedulers act on this optimizer's groups
  // Also here: a loaded state dict's options may ask for it.
  internal::check_no_param_remainders(*inner_, "DiLoCo", kOuterWrites);
  at::Tensor loss = inner_->step(std::move(closure));
  sync_options(/*to_inner=*/false);
  const int64_t interval = options_.sync_every / options_.fragments;
  if (options_.quorum != nullptr) {
    if (++local_step_ >= interval) {
      local_step_ = 0;  // the round's inner steps are done (a healer's state dict says so too)
      quorum_sync(/*has_update=*/true);
    }
    return loss;
  }
  const std::vector<int64_t>& fragment =
      fragments_[static_cast<size_t>(outer_step_ % options_.fragments)];
  ++local_step_;
  if (local_step_ == interval - options_.fragment_sync_delay) prepare_sync(fragment);
  if (local_step_ >= interval) {
    perform_sync(fragment);
    local_step_ = 0;
    ++outer_step_;
  }
  return loss;
}

std::vector<at::Tensor> DiLoCo::checked_local_params() const {
  std::vector<at::Tensor> local = local_params();
  TORCH_CHECK(local.size() == global_.size(), "DiLoCo: the inner optimizer has ", local.size(),
              " parameters, DiLoCo was built over ", global_.size(),
              "; parameters cannot be added or removed after construction: build a new DiLoCo");
  return local;
}

// Pseudo-gradients (global minus local, in the global copies' precision), averaged as
// average_parameters averages: each divided by the group's size, then one all-reduce (sum), or
// compressed (compressed_average's first half). Issued, not waited.
void DiLoCo::prepare_sync(const std::vector<int64_t>& fragment) {
  c10::NoGradGuard no_grad;
  const std::vector<at::Tensor> local = checked_local_params();
  std::vector<at::Tensor> parts;
  for (int64_t i : fragment) parts.push_back((global_[i] - local[i].detach()).reshape(-1));
  at::Tensor flat = at::cat(parts);
  Pending pending;
  if (options_.outer_compression == "none") {
    flat.div_(options_.group.size());
    std::vector<at::Tensor> bufs = {flat};
    pending.work = options_.group->allreduce(bufs);
    pending.average = flat;
  } else {
    pending.compressed =
        start_compressed_average(options_.group, flat.to(at::kFloat), options_.outer_compression);
  }
  pending_ = std::move(pending);
}

at::Tensor DiLoCo::wait_pending() {
  TORCH_INTERNAL_ASSERT(pending_.has_value(), "DiLoCo: a sync without its prepared average");
  Pending& p = *pending_;
  if (p.work) p.work->wait();
  p.work.reset();
  if (p.compressed.has_value()) p.average = finish_compressed_average(*p.compressed);
  p.compressed.reset();
  return p.average;
}

void DiLoCo::perform_sync(const std::vector<int64_t>& fragment) {
  const at::Tensor flat = wait_pending();
  pending_.reset();
  c10::NoGradGuard no_grad;
  const std::vector<at::Tensor> local = checked_local_params();
  std::vector<at::Tensor> grads(global_.size());  // undefined: not this fragment's, left alone
  int64_t offset = 0;
  for (int64_t i : fragment) {
    const int64_t n = global_[i].numel();
    grads[i] = flat.narrow(0, offset, n).view(global_[i].sizes()).to(global_[i].scalar_type());
    offset += n;
  }
  outer_->step(grads);
  const double alpha = options_.fragment_update_alpha;
  for (int64_t i : fragment) {
    at::Tensor p = local[i].detach();
    if (alpha == 0.0) {
      p.copy_(global_[i]);
    } else {  // torchft's merge: the new global parameters lerped towards the local ones
      p.copy_(at::lerp(global_[i], p.to(global_[i].scalar_type()), alpha));
    }
  }
}

namespace {

// The inner optimizer's state dict: a ZeroRedundancyOptimizer's global one (consolidated first),
// any other's through optimizer_state_dict.
c10::IValue inner_state_dict(torch::optim::Optimizer& inner) {
  if (auto* zero = dynamic_cast<ZeroRedundancyOptimizer*>(&inner)) return zero->state_dict();
  return optimizer_state_dict(inner);
}

void load_inner_state_dict(torch::optim::Optimizer& inner, const c10::IValue& state_dict) {
  if (auto* zero = dynamic_cast<ZeroRedundancyOptimizer*>(&inner)) {
    zero->load_state_dict(state_dict);
  } else {
    load_optimizer_state_dict(inner, state_dict);
  }
}

}  // namespace

c10::IValue DiLoCo::state_dict() {
  sync_options(/*to_inner=*/true);
  c10::IValue sd = inner_state_dict(*inner_);
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("local_step", local_step_);
  d.insert("outer_step", outer_step_);
  d.insert("sync_every", options_.sync_every);
  d.insert("fragments", options_.fragments);
  d.insert("outer_compression", options_.outer_compression);
  d.insert("fragment_sync_delay", options_.fragment_sync_delay);
  if (pending_.has_value()) d.insert("pending_average", wait_pending());
  c10::List<at::Tensor> globals;
  for (const at::Tensor& g : global_) globals.push_back(g);
  d.insert("global_params", globals);
  d.insert("outer_optimizer", outer_->state_dict());
  sd.toGenericDict().insert_or_assign(kDiLoCoKey, d);
  return sd;
}

namespace {

// The "diloco" entry's global parameters, each checked against its global copy.
std::vector<at::Tensor> checked_globals(const c10::impl::GenericDict& d,
                                        const std::vector<at::Tensor>& global) {
  TORCH_CHECK(d.contains("global_params"), kLoad,
              "the 'diloco' entry has no 'global_params' (the global parameters)", kSameRun);
  const c10::IValue v = d.at("global_params");
  TORCH_CHECK(v.isList(), kLoad, "diloco.global_params is a ", v.tagKind(),
              ", not a list of tensors", kSameRun);
  const c10::List<c10::IValue> list = v.toList();
  TORCH_CHECK(list.size() == global.size(), kLoad, "diloco.global_params holds ", list.size(),
              " tensors, this DiLoCo has ", global.size(), " parameters", kSameRun);
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const c10::IValue e = list.get(i);
    TORCH_CHECK(e.isTensor(), kLoad, "diloco.global_params[", i, "] is a ", e.tagKind(),
                ", not a tensor", kSameRun);
    const at::Tensor t = e.toTensor();
    TORCH_CHECK(t.defined() && t.layout() == at::kStrided, kLoad, "diloco.global_params[", i,
                "] is not a dense tensor", kSameRun);
    TORCH_CHECK(t.sizes().equals(global[i].sizes()), kLoad, "diloco.global_params[", i,
                "] has shape ", shape_of(t.sizes()), ", parameter ", i, " has shape ",
                shape_of(global[i].sizes()), kSameRun);
    TORCH_CHECK(t.scalar_type() == global[i].scalar_type(), kLoad, "diloco.global_params[", i,
                "] is ", t.scalar_type(), ", the global copy of parameter ", i, " is ",
                global[i].scalar_type(), kSameRun);
    TORCH_CHECK(at::isfinite(t).all().item<bool>(), kLoad, "diloco.global_params[", i,
                "] has a value that is not finite (nan or inf)", kSameRun);
    out.push_back(t);
  }
  return out;
}

// The "diloco" entry's "pending_average": present exactly when `in_flight` (an all-reduce was in
// flight when the dict was taken), then 1-D with `numel` elements of `dtype`, finite.
std::optional<at::Tensor> checked_pending(const c10::impl::GenericDict& d, bool in_flight,
                                          int64_t numel, at::ScalarType dtype) {
  const bool present = d.contains("pending_average") && !d.at("pending_average").isNone();
  TORCH_CHECK(present == in_flight, kLoad, "diloco.pending_average is ",
              present ? "present" : "absent", " but local_step and fragment_sync_delay say ",
              in_flight ? "a" : "no", " fragment's all-reduce was in flight", kSameRun);
  if (!present) return std::nullopt;
  const c10::IValue v = d.at("pending_average");
  TORCH_CHECK(v.isTensor(), kLoad, "diloco.pending_average is a ", v.tagKind(), ", not a tensor",
              kSameRun);
  const at::Tensor t = v.toTensor();
  TORCH_CHECK(t.defined() && t.layout() == at::kStrided && t.dim() == 1 && t.numel() == numel,
              kLoad, "diloco.pending_average is not a 1-D dense tensor of ", numel,
              " elements (the fragment's)", kSameRun);
  TORCH_CHECK(t.scalar_type() == dtype, kLoad, "diloco.pending_average is ", t.scalar_type(),
              ", the fragment's average is ", dtype, kSameRun);
  TORCH_CHECK(at::isfinite(t).all().item<bool>(), kLoad,
              "diloco.pending_average has a value that is not finite (nan or inf)", kSameRun);
  return t;
}

}  // namespace

void DiLoCo::load_state_dict(const c10::IValue& state_dict) {
  TORCH_CHECK(state_dict.isGenericDict(), kLoad, "the state dict is a ", state_dict.tagKind(),
              ", not a dict", kSameRun);
  const c10::impl::GenericDict sd = state_dict.toGenericDict();
  TORCH_CHECK(sd.contains(kDiLoCoKey), kLoad,
              "the state dict has no 'diloco' entry (it is not from DiLoCo::state_dict(): an "
              "inner optimizer's alone lacks the global parameters and the outer state)",
              kSameRun);
  const c10::IValue entry = sd.at(kDiLoCoKey);
  TORCH_CHECK(entry.isGenericDict(), kLoad, "'diloco' is a ", entry.tagKind(), ", not a dict",
              kSameRun);
  const c10::impl::GenericDict d = entry.toGenericDict();
  int_entry(d, "sync_every", options_.sync_every, options_.sync_every,
            "it must equal this DiLoCo's sync_every");
  int_entry(d, "fragments", options_.fragments, options_.fragments,
            "it must equal this DiLoCo's fragments");
  check_compression_entry(d, options_.outer_compression);
  const int64_t delay = options_.fragment_sync_delay;
  if (d.contains("fragment_sync_delay") || delay != 0) {  // absent: written before the option
    int_entry(d, "fragment_sync_delay", delay, delay,
              "it must equal this DiLoCo's fragment_sync_delay");
  }
  const int64_t interval = options_.sync_every / options_.fragments;
  const int64_t local_step =
      int_entry(d, "local_step", 0, interval - 1, "inner steps since the last sync");
  const int64_t outer_step =
      int_entry(d, "outer_step", 0, std::numeric_limits<int64_t>::max(), "syncs so far");
  const std::vector<at::Tensor> globals = checked_globals(d, global_);
  int64_t numel = 0;
  at::ScalarType dtype = at::kFloat;  // the flat pseudo-gradient's: at::cat promotes to float64
  for (int64_t i : fragments_[static_cast<size_t>(outer_step % options_.fragments)]) {
    numel += global_[i].numel();
    if (options_.outer_compression == "none" && global_[i].scalar_type() == at::kDouble) {
      dtype = at::kDouble;
    }
  }
  const std::optional<at::Tensor> pending =
      checked_pending(d, delay > 0 && local_step >= interval - delay, numel, dtype);
  TORCH_CHECK(d.contains("outer_optimizer"), kLoad,
              "the 'diloco' entry has no 'outer_optimizer' (the outer optimizer's state)",
              kSameRun);
  const c10::IValue outer_sd = d.at("outer_optimizer");
  if (absl::Status ok = outer_->check_state_dict(outer_sd); !ok.ok()) {
    TORCH_CHECK(false, kLoad, "diloco.outer_optimizer: ", ok.message());
  }
  try {
    load_inner_state_dict(*inner_, state_dict);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, kLoad, "the inner optimizer's state: ", e.what_without_backtrace());
  }
  sync_options(/*to_inner=*/false);
  outer_->load_state_dict(outer_sd);
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < global_.size(); ++i) global_[i].copy_(globals[i]);
  local_step_ = local_step;
  outer_step_ = outer_step;
  pending_.reset();
  if (pending.has_value()) pending_ = Pending{{}, std::nullopt, pending->clone()};
}

}  // namespace dtrain::optim
