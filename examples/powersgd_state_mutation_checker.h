// The machinery of examples:powersgd_state_mutation_test (see its comment): the two ranks' PowerSGD
// hook state files, written once per test process, a model whose buckets the hook runs on, a
// Checker that resumes each mutant as examples:train resumes a hook state -- on two ranks: rank 0
// loads the mutant, rank 1 its own file, each checks its file against the model's buckets, the
// ranks agree on the verdict before any collective, and only then run the next step together --
// and compares that step with the original files', and helpers that edit a state dict.
//
//   sweep("PowerSGD state file", 500, [](const c10::IValue& base, Checker& s) {
//     s.value("iter = 7", with(base, "iter", int64_t{7}));   // a checksum-valid mutant
//     s.bytes("cut at 10", read_file(original_file()).substr(0, 10));
//     s.hostile("p_memory_dict[0] of 5", with_memory(...), "'p_memory_dict'[0]");  // must be refused
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
#include "comm/agreement.h"
#include "comm/process_group.h"
#include "ddp_hooks/powersgd_hook.h"

namespace dtrain::examples::mutation {

using ddp_hooks::PowerSGDBucket;
using ddp_hooks::PowerSGDExpected;
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
  size_t bucket_count() const { return params_.size(); }
  // What examples:train passes the load (ddp_hooks::powersgd_buckets of its DDP engine).
  std::vector<PowerSGDBucket> buckets() const {
    std::vector<PowerSGDBucket> out;
    for (const auto& params : params_) {
      PowerSGDBucket b{{}, at::kFloat};
      for (const auto& p : params) b.shapes.push_back(p.sizes().vec());
      out.push_back(std::move(b));
    }
    return out;
  }

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

// Rank `rank`'s state file (hook-rank<rank>.pt) after kSavedIter iterations on two ranks; both
// written once per test process.
const std::string& original_file(int rank = 0);

enum class Outcome {
  kRefusedAtLoad,      // checkpoint::load_state refused the file
  kRefusedAtState,     // PowerSGDState::load_state_dict refused it, before any collective
  kRefusedAtFirstUse,  // the hook refused it at its first use (the other rank may be in a collective)
  kIdentical,
  kSameStep,
  kDifferent,
  kSilentNaN,  // loaded, and the next step trained non-finite numbers
  kBroken      // an exception escaped, or the ranks disagreed
};
const char* name(Outcome o);

std::string read_file(const std::string& path);

// Writes mutants to `path` (rank 0 only), resumes each on two ranks as examples:train resumes a
// hook state, runs the next step when both ranks' files were accepted and compares it with the
// original files'; counts the outcomes. Every method is called by both ranks, in the same order.
class Checker {
 public:
  Checker(comm::Group& group, std::string path) : group_(group), path_(std::move(path)) {}

  // The original files' next step: what a mutant that loads must reproduce. False on failure.
  bool init();

  bool leader() const { return group_.rank() == 0; }
  const std::string& path() const { return path_; }
  int mutants() const { return mutants_; }

  void bytes(const std::string& what, const std::string& b) {
    if (leader()) std::ofstream(path_, std::ios::binary | std::ios::trunc) << b;
    record(what);
  }
  // A checksum-valid file holding `v`.
  void value(const std::string& what, const c10::IValue& v) {
    if (write(what, v)) record(what);
  }
  // A checksum-valid file holding `v` that must be refused at load, in one line naming the file
  // and `names` (the key, and the bucket where there is one): counted apart (report_hostile).
  void hostile(const std::string& what, const c10::IValue& v, const std::string& names);
  // A checksum-valid file holding `v` that PyTorch's hook semantics make a legal state (documented
  // in ddp_hooks/powersgd_hook.h): it must load and train `expected` (finite numbers).
  void legal(const std::string& what, const c10::IValue& v, Outcome expected);
  // Writes `v` to path() (rank 0); false (a test failure) when it cannot.
  bool write(const std::string& what, const c10::IValue& v);

  void report(const std::string& title) const;
  void report_hostile(const std::string& title) const;
  int hostile_files() const { return hostile_files_; }
  int hostile_refused() const { return hostile_refused_; }

  // The outcome of path() on rank 0 (rank 1: its own file), not counted; `message` gets rank 0's
  // refusal.
  Outcome check(const std::string& what, std::string* message = nullptr);

 private:
  void record(const std::string& what) {
    const Outcome o = check(what);
    ++mutants_;
    ++counts_[o];
    if (leader() && (o == Outcome::kDifferent || o == Outcome::kSilentNaN))
      ADD_FAILURE() << what << ": loaded, and trains " << name(o);
  }
  // Loads this rank's file into a fresh state; rank 0's message checked.
  absl::Status load(const std::string& what, const std::string& file,
                    std::shared_ptr<PowerSGDState>& state, Outcome& refused);
  Outcome compare(const Model::Step& next, const c10::IValue& after) const;
  bool same_step(const Model::Step& next, const c10::IValue& after) const;

  comm::Group& group_;
  const Model model_;
  std::string path_;
  Model::Step reference_;
  c10::IValue reference_state_;
  int mutants_ = 0;
  std::map<Outcome, int> counts_;
  int hostile_files_ = 0, hostile_refused_ = 0, legal_files_ = 0;
  std::map<Outcome, int> hostile_counts_;
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
