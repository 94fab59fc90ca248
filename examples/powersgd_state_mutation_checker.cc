#include "examples/powersgd_state_mutation_checker.h"

#include <chrono>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/state_file.h"
#include "comm/agreement.h"
#include "comm/process_group.h"
#include "comm/testing/test_harness.h"

namespace dtrain::examples::mutation {

std::shared_ptr<PowerSGDState> make_state(comm::Group& g) {
  auto s = std::make_shared<PowerSGDState>(g);
  s->matrix_approximation_rank = 1;
  s->start_powerSGD_iter = 2;
  s->random_seed = 3;
  return s;
}

const std::string& original_file(int rank) {
  static const std::vector<std::string>* paths = [] {
    auto* p = new std::vector<std::string>{::testing::TempDir() + "hook-rank0.pt",
                                           ::testing::TempDir() + "hook-rank1.pt"};
    comm::testing::run_ranks_as_threads(2, [p](comm::Group& g) {
      auto state = make_state(g);
      PowerSGDHook hook(state);
      const Model model;
      for (int iter = 0; iter < kSavedIter; ++iter) {
        const Model::Step s = model.step(hook, g.rank(), iter);
        ASSERT_FALSE(s.error.has_value()) << *s.error;
      }
      ASSERT_TRUE(state->iter == kSavedIter && state->error_dict.size() == 2 &&
                  state->p_memory_dict.size() == 2);
      const absl::Status s = checkpoint::save_state((*p)[g.rank()], state->state_dict());
      ASSERT_TRUE(s.ok()) << s;
    });
    return p;
  }();
  return paths->at(static_cast<size_t>(rank));
}

const char* name(Outcome o) {
  switch (o) {
    case Outcome::kRefusedAtLoad:
      return "refused at load (checkpoint::load_state)";
    case Outcome::kRefusedAtState:
      return "refused at state (load_state_dict)";
    case Outcome::kRefusedAtFirstUse:
      return "refused at the hook's first use";
    case Outcome::kIdentical:
      return "identical";
    case Outcome::kSameStep:
      return "the same step";
    case Outcome::kDifferent:
      return "another step";
    case Outcome::kSilentNaN:
      return "non-finite numbers";
    case Outcome::kBroken:
      return "broken";
  }
  return "?";
}

absl::Status Checker::load(const std::string& what, const std::string& file,
                           std::shared_ptr<PowerSGDState>& state, Outcome& refused) {
  absl::StatusOr<c10::IValue> loaded = checkpoint::load_state(file);
  refused = Outcome::kRefusedAtLoad;
  if (!loaded.ok()) {
    EXPECT_TRUE(absl::StrContains(loaded.status().message(), file))
        << what << ": " << loaded.status();
    EXPECT_TRUE(absl::IsDataLoss(loaded.status()) || absl::IsInvalidArgument(loaded.status()))
        << what << ": " << loaded.status();
    return loaded.status();
  }
  state = make_state(group_);
  // As examples:train resumes: against the model's buckets, at the checkpoint's step.
  const absl::Status s = state->load_state_dict(
      *loaded, PowerSGDExpected{.iter = kSavedIter, .buckets = model_.buckets(), .file = file});
  refused = Outcome::kRefusedAtState;
  if (!s.ok()) {
    EXPECT_TRUE(absl::StartsWith(s.message(), "PowerSGD state file " + file + ": "))
        << what << ": " << s;
    EXPECT_EQ(s.message().find('\n'), absl::string_view::npos) << what << ": " << s;
    EXPECT_TRUE(absl::IsDataLoss(s) || absl::IsInvalidArgument(s)) << what << ": " << s;
    EXPECT_TRUE(state->iter == 0 && state->error_dict.empty() && state->p_memory_dict.empty() &&
                !state->rng_seeded)
        << what << ": the refused load changed the state";
  }
  return s;
}

Outcome Checker::check(const std::string& what, std::string* message) {
  const std::string file = leader() ? path_ : original_file(1);
  std::shared_ptr<PowerSGDState> state;
  Outcome refused = Outcome::kBroken;
  absl::Status mine;
  try {
    mine = load(what, file, state, refused);
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": an exception escaped loading it: " << e.what();
    mine = absl::InternalError(e.what());
    refused = Outcome::kBroken;
  }
  if (message != nullptr) *message = mine.ok() ? "" : std::string(mine.message());
  // As examples:train: the ranks agree on the verdict before any collective of the step.
  const absl::Status all = comm::first_failure(group_, mine);
  if (!mine.ok()) return refused;
  if (!all.ok()) {
    if (leader()) ADD_FAILURE() << what << ": rank 1 refused its own file: " << all;
    return leader() ? Outcome::kBroken : Outcome::kRefusedAtState;  // rank 1 follows rank 0
  }
  Model::Step next;
  c10::IValue after;
  try {
    PowerSGDHook hook(state);
    next = model_.step(hook, group_.rank(), kSavedIter);  // catches the hook's c10::Error
    after = state->state_dict();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": an exception escaped the step after loading it: " << e.what();
    return Outcome::kBroken;
  }
  if (next.error.has_value()) {  // the load's check missed what the hook found: the old abort
    ADD_FAILURE() << what << ": loaded, then refused by the hook at its first use"
                  << (next.failed_bucket_unchanged ? "" : ", after changing the bucket") << ": "
                  << *next.error;
    return Outcome::kRefusedAtFirstUse;
  }
  return compare(next, after);
}

Outcome Checker::compare(const Model::Step& next, const c10::IValue& after) const {
  for (const at::Tensor& t : next.buffers) {
    if (!at::isfinite(t).all().item<bool>()) return Outcome::kSilentNaN;
  }
  if (!same_step(next, after)) return Outcome::kDifferent;
  return checkpoint::testing::same_values(after, reference_state_) ? Outcome::kIdentical
                                                                   : Outcome::kSameStep;
}

// The same averaged gradients, iter, and error / P / Q memories of every bucket after the step
// (the counters, the RNG state, which the step did not use, and entries for buckets the model
// does not have may differ).
bool Checker::same_step(const Model::Step& next, const c10::IValue& after) const {
  for (size_t b = 0; b < model_.bucket_count(); ++b) {
    if (!next.buffers[b].equal(reference_.buffers[b])) return false;
  }
  const GenericDict x = after.toGenericDict(), y = reference_state_.toGenericDict();
  if (!checkpoint::testing::same_values(x.at("iter"), y.at("iter"))) return false;
  for (const char* key : {"error_dict", "p_memory_dict", "q_memory_dict"}) {
    const GenericDict mx = x.at(key).toGenericDict(), my = y.at(key).toGenericDict();
    for (size_t b = 0; b < model_.bucket_count(); ++b) {
      const c10::IValue index(static_cast<int64_t>(b));
      if (mx.contains(index) != my.contains(index)) return false;
      if (mx.contains(index) && !checkpoint::testing::same_values(mx.at(index), my.at(index)))
        return false;
    }
  }
  return true;
}

bool Checker::init() {
  const std::string file = original_file(group_.rank());
  std::shared_ptr<PowerSGDState> state;
  Outcome refused;
  const absl::Status mine = load("the original file", file, state, refused);
  EXPECT_TRUE(mine.ok()) << mine;
  if (!comm::first_failure(group_, mine).ok()) return false;
  PowerSGDHook hook(state);
  reference_ = model_.step(hook, group_.rank(), kSavedIter);
  EXPECT_FALSE(reference_.error.has_value()) << reference_.error.value_or("");
  reference_state_ = state->state_dict();
  return !reference_.error.has_value();
}

bool Checker::write(const std::string& what, const c10::IValue& v) {
  if (!leader()) return true;
  const absl::Status s = checkpoint::save_state(path_, v);
  if (!s.ok()) ADD_FAILURE() << what << ": cannot write the mutant: " << s;
  return s.ok();
}

void Checker::hostile(const std::string& what, const c10::IValue& v, const std::string& names) {
  if (!write(what, v)) return;
  std::string message;
  const Outcome o = check(what, &message);
  ++hostile_files_;
  ++hostile_counts_[o];
  if (!leader()) return;
  const bool named = o == Outcome::kRefusedAtState && absl::StrContains(message, path_) &&
                     absl::StrContains(message, names) && message.find('\n') == std::string::npos;
  if (named) ++hostile_refused_;
  std::cout << "  " << what << " -> " << (message.empty() ? name(o) : message) << "\n";
  if (!named) {
    ADD_FAILURE() << what << ": " << name(o) << (message.empty() ? "" : ": ") << message
                  << " (expected a refusal at load naming " << path_ << " and " << names << ")";
  }
}

void Checker::legal(const std::string& what, const c10::IValue& v, Outcome expected) {
  if (!write(what, v)) return;
  const Outcome o = check(what);
  ++legal_files_;
  if (leader()) {
    std::cout << "  " << what << " -> loads (a legal state): " << name(o) << "\n";
    EXPECT_EQ(name(o), std::string(name(expected))) << what;
  }
}

void Checker::report(const std::string& title) const {
  auto n = [&](Outcome o) { return counts_.count(o) > 0 ? counts_.at(o) : 0; };
  std::cout << title << ": " << mutants_ << " mutants: " << n(Outcome::kRefusedAtLoad)
            << " refused at load (checkpoint::load_state), " << n(Outcome::kRefusedAtState)
            << " refused at state (load_state_dict, before any collective), "
            << n(Outcome::kRefusedAtFirstUse) << " refused at the hook's first use, "
            << n(Outcome::kIdentical) << " identical, " << n(Outcome::kSameStep)
            << " the same step (only counters, the RNG state or unused entries differ), "
            << n(Outcome::kDifferent) << " different, " << n(Outcome::kSilentNaN) << " silent NaN, "
            << n(Outcome::kBroken) << " broken\n";
}

void Checker::report_hostile(const std::string& title) const {
  auto n = [&](Outcome o) { return hostile_counts_.count(o) > 0 ? hostile_counts_.at(o) : 0; };
  std::cout << title << ": " << hostile_files_
            << " checksum-valid hostile hook files: " << hostile_refused_
            << " refused at load, before any collective, in one line naming the file, the key "
               "and the bucket; "
            << n(Outcome::kBroken) + n(Outcome::kRefusedAtFirstUse)
            << " aborts (an exception, a disagreement or the hook's first-use refusal), "
            << n(Outcome::kSilentNaN) << " silent NaN, " << n(Outcome::kDifferent) << " different, "
            << n(Outcome::kIdentical) + n(Outcome::kSameStep) << " accepted; " << legal_files_
            << " legal states loaded as documented\n";
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

c10::IValue with(const c10::IValue& base, const std::string& key, c10::IValue value, bool drop) {
  GenericDict d = base.toGenericDict().copy();
  if (drop) d.erase(key);
  if (!drop) d.insert_or_assign(key, std::move(value));
  return d;
}
GenericDict untyped(const c10::IValue& dict) {
  GenericDict out(c10::AnyType::get(), c10::AnyType::get());
  for (const auto& kv : dict.toGenericDict()) out.insert(kv.key(), kv.value());
  return out;
}
c10::IValue with_memory(const c10::IValue& base, const std::string& key,
                        const std::function<void(GenericDict&)>& edit) {
  GenericDict m = untyped(base.toGenericDict().at(key));
  edit(m);
  return with(base, key, m);
}
at::Tensor entry(const c10::IValue& base, const std::string& key, int64_t bucket) {
  return base.toGenericDict().at(key).toGenericDict().at(bucket).toTensor();
}

void sweep(const std::string& title, int at_least,
           const std::function<void(const c10::IValue&, Checker&)>& mutate) {
  const std::string& original = original_file(0);
  original_file(1);
  absl::StatusOr<c10::IValue> base = checkpoint::load_state(original);
  ASSERT_TRUE(base.ok()) << base.status();
  ASSERT_TRUE(base->isGenericDict());
  comm::testing::HarnessOptions options;
  options.timeout = std::chrono::minutes(5);  // the sweep's length, not a peer's
  comm::testing::run_ranks_as_threads(
      2,
      [&](comm::Group& g) {
        Checker s(g, ::testing::TempDir() + "mutant.pt");
        if (!s.init()) return;
        mutate(*base, s);
        if (!s.leader()) return;
        s.report(absl::StrCat(title, " (", read_file(original).size(), "-byte file)"));
        EXPECT_GE(s.mutants(), at_least);
      },
      options);
}

}  // namespace dtrain::examples::mutation
