// The machinery of examples:powersgd_state_mutation_test (see its comment): a PowerSGD hook state
// file written once per test process, a model whose buckets the hook runs on, a Checker that loads
// each mutant as examples:train resumes a hook state and compares its next step with the
// original's, and helpers that edit a state dict.
//
//   sweep("PowerSGD state file", 500, [](const c10::IValue& base, Checker& s) {
//     s.value("iter = 7", with(base, "iter", int64_t{7}));   // a checksum-valid mutant
//     s.bytes("cut at 10", read_file(original_file()).substr(0, 10));
//   });
#ifndef DTRAIN_EXAMPLES_POWERSGD_STATE_MUTATION_CHECKER_H_
#define DTRAIN_EXAMPLES_POWERSGD_STATE_MUTATION_CHECKER_H_

#include <cstdint>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "checkpoint/fuzz_support.h"
#include "checkpoint/state_file.h"
#include "comm/process_group.h"
#include "ddp_hooks/powersgd_hook.h"

namespace dtrain::examples::mutation {

using ddp_hooks::PowerSGDHook;
using ddp_hooks::PowerSGDState;
using GenericDict = c10::impl::GenericDict;

constexpr int kSavedIter = 5;  // iterations before the save: 2 plain all-reduces, then 3 compressed

// The settings of the run that wrote the file, and of every run that resumes it.
std::shared_ptr<PowerSGDState> make_state(comm::Group& g);

// The model's gradients as DDP buckets them: bucket 0 a 12x10 weight and its bias, bucket 1 an 8x6
// and a 4x3 weight and a 5-vector. The 12x10 and 8x6 matrices are compressed; the 4x3 one is not
// worth it (min_compression_rate 2) and is averaged with the vectors.
class Model {
 public:
  struct Step {
    std::vector<at::Tensor> buffers;  // every bucket's contents after the hook
    std::optional<std::string>
        error;  // the c10::Error a bucket's hook threw (the step stops there)
    bool failed_bucket_unchanged = false;
  };

  Model() {
    for (const auto& shapes :
         std::vector<std::vector<std::vector<int64_t>>>{{{12, 10}, {12}}, {{8, 6}, {4, 3}, {5}}}) {
      std::vector<at::Tensor> params;
      for (const auto& shape : shapes)
        params.push_back(at::zeros(shape, at::TensorOptions().dtype(at::kFloat)));
      params_.push_back(std::move(params));
    }
  }
  size_t buckets() const { return params_.size(); }

  // Iteration `iter`'s gradients of `rank` in bucket `b` (fixed seeds).
  at::Tensor gradients(int rank, int iter, size_t b) const {
    int64_t numel = 0;
    for (const auto& p : params_[b]) numel += p.numel();
    at::Generator gen =
        at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * iter + 10 * rank) + b);
    return at::randn({numel}, gen, at::TensorOptions().dtype(at::kFloat));
  }

  // Runs the hook on every bucket of iteration `iter` (the last bucket closes the iteration).
  Step step(PowerSGDHook& hook, int rank, int iter) const {
    Step out;
    for (size_t b = 0; b < params_.size(); ++b) {
      at::Tensor buffer = gradients(rank, iter, b);
      const at::Tensor before = buffer.clone();
      std::vector<size_t> offsets, lengths;
      std::vector<c10::IntArrayRef> sizes;
      for (const auto& p : params_[b]) {
        offsets.push_back(offsets.empty() ? 0 : offsets.back() + lengths.back());
        lengths.push_back(static_cast<size_t>(p.numel()));
        sizes.push_back(p.sizes());
      }
      // What ddp_hooks/libtorch_compat.h's make_grad_bucket (private to ddp_hooks) builds.
      c10d::GradBucket bucket(b, params_.size(), buffer, offsets, lengths, sizes, params_[b],
                              std::nullopt);
      try {
        hook.runHook(bucket)->waitAndThrow();
      } catch (const c10::Error& e) {
        out.error = e.what_without_backtrace();
        out.failed_bucket_unchanged = buffer.equal(before);
        return out;
      }
      out.buffers.push_back(buffer);
    }
    return out;
  }

 private:
  std::vector<std::vector<at::Tensor>> params_;
};

// Rank 0's state file after kSavedIter iterations on two ranks; written once per test process.
const std::string& original_file();

enum class Outcome {
  kRefusedAtLoad,
  kRefusedAtState,
  kRefusedAtFirstUse,
  kIdentical,
  kSameStep,
  kDifferent,
  kBroken
};

std::string read_file(const std::string& path);

// Writes mutants to `path`, loads each as examples:train resumes a hook state, runs the next step
// and compares it with the original file's; counts the outcomes.
class Checker {
 public:
  Checker(comm::Group& group, std::string path) : group_(group), path_(std::move(path)) {}

  // The original file's next step: what a mutant that loads must reproduce. False on failure.
  bool init(const std::string& original) {
    absl::StatusOr<c10::IValue> loaded = checkpoint::load_state(original);
    auto state = make_state(group_);
    const absl::Status s =
        loaded.ok() ? state->load_state_dict(*loaded, kSavedIter) : loaded.status();
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) return false;
    PowerSGDHook hook(state);
    reference_ = model_.step(hook, 0, kSavedIter);
    EXPECT_FALSE(reference_.error.has_value()) << reference_.error.value_or("");
    reference_state_ = state->state_dict();
    return !reference_.error.has_value();
  }

  const std::string& path() const { return path_; }
  int mutants() const { return mutants_; }

  void bytes(const std::string& what, const std::string& b) {
    std::ofstream(path_, std::ios::binary | std::ios::trunc) << b;
    record(what);
  }
  // A checksum-valid file holding `v`.
  void value(const std::string& what, const c10::IValue& v) {
    const absl::Status s = checkpoint::save_state(path_, v);
    if (s.ok()) record(what);
    if (!s.ok()) ADD_FAILURE() << what << ": cannot write the mutant: " << s;
  }

  void report(const std::string& title) {
    std::cout << title << ": " << mutants_ << " mutants: " << counts_[Outcome::kRefusedAtLoad]
              << " refused at load (checkpoint::load_state), " << counts_[Outcome::kRefusedAtState]
              << " refused at state (load_state_dict), " << counts_[Outcome::kRefusedAtFirstUse]
              << " refused at the hook's first use, " << counts_[Outcome::kIdentical]
              << " identical, " << counts_[Outcome::kSameStep]
              << " the same step (only counters, the RNG state or unused entries "
              << "differ), " << counts_[Outcome::kDifferent] << " different, "
              << counts_[Outcome::kBroken] << " broken\n";
  }

  // The file at path()'s outcome (not counted).
  Outcome check(const std::string& what) {
    absl::StatusOr<c10::IValue> loaded = checkpoint::load_state(path_);
    if (!loaded.ok()) {
      EXPECT_TRUE(absl::StrContains(loaded.status().message(), path_))
          << what << ": " << loaded.status();
      EXPECT_TRUE(absl::IsDataLoss(loaded.status()) || absl::IsInvalidArgument(loaded.status()))
          << what << ": " << loaded.status();
      return Outcome::kRefusedAtLoad;
    }
    std::shared_ptr<PowerSGDState> state = make_state(group_);
    absl::Status s;
    Model::Step next;
    c10::IValue after;
    try {
      s = state->load_state_dict(*loaded, kSavedIter);
      if (s.ok()) {
        PowerSGDHook hook(state);
        next = model_.step(hook, 0, kSavedIter);  // catches the hook's c10::Error
        after = state->state_dict();
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << what << ": an exception escaped loading it or the step after: " << e.what();
      return Outcome::kBroken;
    }
    if (!s.ok()) {
      EXPECT_TRUE(absl::StartsWith(s.message(), "PowerSGD state: ")) << what << ": " << s;
      EXPECT_TRUE(absl::IsDataLoss(s) || absl::IsInvalidArgument(s)) << what << ": " << s;
      EXPECT_TRUE(state->iter == 0 && state->error_dict.empty() && state->p_memory_dict.empty() &&
                  !state->rng_seeded)
          << what << ": the refused load changed the state";
      return Outcome::kRefusedAtState;
    }
    if (next.error.has_value()) {
      const bool named = absl::StrContains(*next.error, "PowerSGDHook: the loaded state") &&
                         !absl::StrContains(*next.error, "INTERNAL ASSERT");
      if (named && next.failed_bucket_unchanged) return Outcome::kRefusedAtFirstUse;
      ADD_FAILURE() << what << ": the step after loading it failed "
                    << (named ? "after changing the bucket: " : "without naming the loaded state: ")
                    << *next.error;
      return Outcome::kBroken;
    }
    if (!same_step(next, after)) return Outcome::kDifferent;
    return checkpoint::testing::same_values(after, reference_state_) ? Outcome::kIdentical
                                                                     : Outcome::kSameStep;
  }

 private:
  void record(const std::string& what) {
    const Outcome o = check(what);
    ++mutants_;
    ++counts_[o];
    if (o == Outcome::kDifferent)
      ADD_FAILURE() << what << ": loaded, and trains another next step than the original";
  }

  // The same averaged gradients, iter, and error / P / Q memories of every bucket after the step
  // (the counters, the RNG state, which the step did not use, and entries for buckets the model
  // does not have may differ).
  bool same_step(const Model::Step& next, const c10::IValue& after) const {
    for (size_t b = 0; b < model_.buckets(); ++b) {
      if (!next.buffers[b].equal(reference_.buffers[b])) return false;
    }
    const GenericDict x = after.toGenericDict(), y = reference_state_.toGenericDict();
    if (!checkpoint::testing::same_values(x.at("iter"), y.at("iter"))) return false;
    for (const char* key : {"error_dict", "p_memory_dict", "q_memory_dict"}) {
      const GenericDict mx = x.at(key).toGenericDict(), my = y.at(key).toGenericDict();
      for (size_t b = 0; b < model_.buckets(); ++b) {
        const c10::IValue index(static_cast<int64_t>(b));
        if (mx.contains(index) != my.contains(index)) return false;
        if (mx.contains(index) && !checkpoint::testing::same_values(mx.at(index), my.at(index)))
          return false;
      }
    }
    return true;
  }

  comm::Group& group_;
  const Model model_;
  std::string path_;
  Model::Step reference_;
  c10::IValue reference_state_;
  int mutants_ = 0;
  std::map<Outcome, int> counts_;
};

// `base` (a state dict) with `key` set to `value`, or without `key`.
c10::IValue with(const c10::IValue& base, const std::string& key, c10::IValue value,
                 bool drop = false);
// `dict`'s items in a dict of any key and value types.
GenericDict untyped(const c10::IValue& dict);
// `base` with the memory dict `key` (bucket index -> tensor) edited.
c10::IValue with_memory(const c10::IValue& base, const std::string& key,
                        const std::function<void(GenericDict&)>& edit);
// The tensor of `bucket` in the memory dict `key`.
at::Tensor entry(const c10::IValue& base, const std::string& key, int64_t bucket);

// Runs `mutate` over one rank's Checker of the original file; `title` names the counts line.
void sweep(const std::string& title, int at_least,
           const std::function<void(const c10::IValue&, Checker&)>& mutate);

}  // namespace dtrain::examples::mutation

#endif  // DTRAIN_EXAMPLES_POWERSGD_STATE_MUTATION_CHECKER_H_
