// Property: whatever happens to a PowerSGD hook state file (examples:train's hook-rank<r>.pt) --
// bytes flipped, cut, overwritten or appended, or a checksum-valid file with changed fields
// (settings, iter, counters, the RNG state, the memories' shapes, dtypes, types and keys, keys
// dropped or added) -- resuming from it is refused, by a Status from checkpoint::load_state or
// PowerSGDState::load_state_dict or by the hook's c10::Error at its first use of a memory that does
// not fit its bucket (before that bucket changed), or it trains the same next step as the original
// file: the same averaged gradients and error / P / Q memories. Never a crash, an internal assert or
// a silently different step. The file: rank 0's state after two ranks (threads) ran PowerSGD (rank 1,
// from iteration 2) on two buckets for 5 iterations (3 compressed); the next step runs on one rank.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/fuzz_support.h"
#include "checkpoint/state_file.h"
#include "comm/process_group.h"
#include "comm/testing/test_harness.h"
#include "ddp_hooks/powersgd_hook.h"

namespace dtrain::examples {
namespace {

using ddp_hooks::PowerSGDHook;
using ddp_hooks::PowerSGDState;
using GenericDict = c10::impl::GenericDict;

constexpr int kSavedIter = 5;  // iterations before the save: 2 plain all-reduces, then 3 compressed

// The settings of the run that wrote the file, and of every run that resumes it.
std::shared_ptr<PowerSGDState> make_state(comm::Group& g) {
  auto s = std::make_shared<PowerSGDState>(g);
  s->matrix_approximation_rank = 1;
  s->start_powerSGD_iter = 2;
  s->random_seed = 3;
  return s;
}

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
        hook.runHook(bucket);
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
const std::string& original_file() {
  static const std::string* path = [] {
    auto* p = new std::string(::testing::TempDir() + "hook-rank0.pt");
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
      if (g.rank() == 0) {
        const absl::Status s = checkpoint::save_state(*p, state->state_dict());
        ASSERT_TRUE(s.ok()) << s;
      }
    });
    return p;
  }();
  return *path;
}

enum class Outcome {
  kRefusedAtLoad,
  kRefusedAtState,
  kRefusedAtFirstUse,
  kIdentical,
  kSameStep,
  kDifferent,
  kBroken
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

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
                 bool drop = false) {
  GenericDict d = base.toGenericDict().copy();
  if (drop) d.erase(key);
  if (!drop) d.insert_or_assign(key, std::move(value));
  return d;
}
// `dict`'s items in a dict of any key and value types.
GenericDict untyped(const c10::IValue& dict) {
  GenericDict out(c10::AnyType::get(), c10::AnyType::get());
  for (const auto& kv : dict.toGenericDict()) out.insert(kv.key(), kv.value());
  return out;
}
// `base` with the memory dict `key` (bucket index -> tensor) edited.
c10::IValue with_memory(const c10::IValue& base, const std::string& key,
                        const std::function<void(GenericDict&)>& edit) {
  GenericDict m = untyped(base.toGenericDict().at(key));
  edit(m);
  return with(base, key, m);
}
at::Tensor entry(const c10::IValue& base, const std::string& key, int64_t bucket) {
  return base.toGenericDict().at(key).toGenericDict().at(bucket).toTensor();
}

// Runs `mutate` over one rank's Checker of the original file; `title` names the counts line.
void sweep(const std::string& title, int at_least,
           const std::function<void(const c10::IValue&, Checker&)>& mutate) {
  const std::string& original = original_file();
  absl::StatusOr<c10::IValue> base = checkpoint::load_state(original);
  ASSERT_TRUE(base.ok()) << base.status();
  ASSERT_TRUE(base->isGenericDict());
  comm::testing::HarnessOptions options;
  options.timeout =
      std::chrono::minutes(5);  // one rank: no peer to wait for, only the sweep's length
  comm::testing::run_ranks_as_threads(
      1,
      [&](comm::Group& g) {
        Checker s(g, ::testing::TempDir() + "mutant.pt");
        if (!s.init(original)) return;
        mutate(*base, s);
        s.report(absl::StrCat(title, " (", read_file(original).size(), "-byte file)"));
        EXPECT_GE(s.mutants(), at_least);
      },
      options);
}

TEST(PowerSGDStateFileMutationTest, EveryMutantIsRefusedOrTrainsTheSameNextStep) {
  sweep("PowerSGD state file", 500, [](const c10::IValue& base, Checker& s) {
    // The comparison can fail: a memory with other numbers loads and trains another step.
    ASSERT_TRUE(checkpoint::save_state(
                    s.path(), with_memory(base, "error_dict",
                                          [&](GenericDict& m) {
                                            m.insert_or_assign(int64_t{0},
                                                               entry(base, "error_dict", 0) * 2);
                                          }))
                    .ok());
    EXPECT_EQ(s.check("control: error_dict[0] doubled"), Outcome::kDifferent)
        << "the comparison sees nothing";
    // Damaged bytes: cut, bits flipped, ranges zeroed or overwritten, bytes appended.
    const std::string good = read_file(original_file());
    for (size_t cut = 0; cut < good.size(); cut += cut + 48 < good.size() ? 7 : 1) {
      s.bytes(absl::StrCat("cut at ", cut), good.substr(0, cut));
    }
    for (size_t i = 0; i < good.size(); i += 3) {
      std::string b = good;
      b[i] = static_cast<char>(b[i] ^ (1 << (i % 8)));
      s.bytes(absl::StrCat("bit ", i % 8, " of byte ", i), b);
    }
    std::mt19937 rng(29);
    for (int k = 0; k < 200; ++k) {
      std::string b = good;
      const size_t from = rng() % b.size(), len = 1 + rng() % 64;
      for (size_t i = from; i < std::min(b.size(), from + len); ++i)
        b[i] = k % 2 ? '\0' : static_cast<char>(rng());
      s.bytes(absl::StrCat(k % 2 ? "zeroed " : "random ", len, " bytes at ", from), b);
    }
    for (const std::string& tail :
         {std::string("x"), std::string(100, '\0'), good.substr(good.size() - 40)}) {
      s.bytes(absl::StrCat("appended ", tail.size(), " bytes"), good + tail);
    }
    // Checksum-valid files with changed fields. Any key, any value of another type or out of range:
    const GenericDict empty(c10::StringType::get(), c10::AnyType::get());
    const std::vector<std::pair<std::string, c10::IValue>> odd = {
        {"None", c10::IValue()},
        {"'7'", std::string("7")},
        {"2.5", 2.5},
        {"NaN", std::nan("")},
        {"a tensor", at::ones({5})},
        {"[1, 2]", c10::List<int64_t>({1, 2})},
        {"{}", empty},
        {"True", true},
        {"False", false},
        {"-1", int64_t{-1}},
        {"INT64_MAX", std::numeric_limits<int64_t>::max()},
        {"INT64_MIN", std::numeric_limits<int64_t>::min()},
        {"2^62 + 1", (int64_t{1} << 62) + 1}};
    for (const auto& item : base.toGenericDict()) {  // all 16
      const std::string key = item.key().toStringRef();
      for (const auto& [name, v] : odd) {
        if (key == "error_dict" && name == "{}")
          continue;  // no memory at all: the other test's case
        s.value(absl::StrCat(key, " = ", name), with(base, key, v));
      }
      s.value(absl::StrCat("no ", key), with(base, key, c10::IValue(), /*drop=*/true));
    }
    // Integers near and far from the saved ones (settings, iter, the counters).
    for (const char* key :
         {"matrix_approximation_rank", "start_powerSGD_iter", "random_seed", "iter",
          "total_numel_before_compression", "total_numel_after_compression"}) {
      const int64_t v = base.toGenericDict().at(key).toInt();
      for (int64_t x : {v - 1, v + 1, int64_t{0}, int64_t{1}, 2 * v, -v, int64_t{1} << 31,
                        int64_t{1'000'000'000'000}, int64_t{1'000'000'000'001}, int64_t{1} << 62}) {
        if (x != v) s.value(absl::StrCat(key, " = ", x, " (saved: ", v, ")"), with(base, key, x));
      }
    }
    for (const char* key : {"min_compression_rate", "orthogonalization_epsilon"}) {
      const double v = base.toGenericDict().at(key).toDouble();
      const double inf = std::numeric_limits<double>::infinity();
      for (double x :
           {std::nextafter(v, inf), std::nextafter(v, -inf), -v, 1.0, 0.0, inf, -inf, 1e-300}) {
        s.value(absl::StrCat(key, " = ", x, " (saved: ", v, ")"), with(base, key, x));
      }
      s.value(absl::StrCat(key, " as the int ", static_cast<int64_t>(v)),
              with(base, key, static_cast<int64_t>(v)));
    }
    for (const char* key :
         {"use_error_feedback", "warm_start", "batch_tensors_with_same_shape", "rng_seeded"}) {
      const bool v = base.toGenericDict().at(key).toBool();
      s.value(absl::StrCat(key, " flipped"), with(base, key, !v));
      s.value(absl::StrCat(key, " as an int"), with(base, key, int64_t{v ? 1 : 0}));
    }
    // Keys added, and the whole state replaced.
    s.value("an extra key 'lr'", with(base, "lr", 0.1));
    s.value("an extra key 'iter '", with(base, "iter ", int64_t{kSavedIter}));
    GenericDict int_key = untyped(base);
    int_key.insert(int64_t{7}, int64_t{kSavedIter});
    s.value("an extra int key 7", int_key);
    for (const auto& [name, v] : odd) s.value(absl::StrCat("the state replaced by ", name), v);
    // The RNG state's text.
    const std::string text = base.toGenericDict().at("rng").toStringRef();
    const std::string words = text.substr(0, text.find_last_of(' '));  // without the index
    std::string digit = text, letter = text;
    digit[0] = digit[0] == '9' ? '8' : static_cast<char>(digit[0] + 1);
    letter[text.size() / 2] = 'x';
    for (const auto& [name, v] :
         std::vector<std::pair<std::string, std::string>>{{"empty", ""},
                                                          {"'0'", "0"},
                                                          {"a number appended", text + " 1"},
                                                          {"its index dropped", words},
                                                          {"its first digit changed", digit},
                                                          {"a leading space", " " + text},
                                                          {"a trailing newline", text + "\n"},
                                                          {"negated", "-" + text},
                                                          {"a letter inside", letter},
                                                          {"20000 digits", std::string(20000, '7')},
                                                          {"index 999", words + " 999"},
                                                          {"index 0", words + " 0"}}) {
      s.value(absl::StrCat("rng ", name), with(base, "rng", std::string(v)));
    }
    // The memories: shapes, dtypes, types and keys of each bucket's entry.
    for (const std::string key : {"error_dict", "p_memory_dict", "q_memory_dict"}) {
      for (int64_t b : {int64_t{0}, int64_t{1}}) {
        const at::Tensor t = entry(base, key, b);
        const int64_t n = t.numel();
        const std::string where = absl::StrCat(key, "[", b, "]");
        auto set = [&](const std::string& what, c10::IValue v) {
          s.value(absl::StrCat(where, " ", what),
                  with_memory(base, key, [&](GenericDict& m) { m.insert_or_assign(b, v); }));
        };
        set("one shorter", t.narrow(0, 0, n - 1).clone());
        set("one longer", at::cat({t, at::zeros({1}, t.options())}));
        set("empty", at::empty({0}, t.options()));
        set("doubled in length", at::cat({t, t}));
        set("as 1 x n", t.reshape({1, n}).clone());
        set("as n x 1", t.reshape({n, 1}).clone());
        set("as a 0-D tensor", t.select(0, 0).clone());
        for (at::ScalarType dtype :
             {at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt, at::kShort, at::kChar,
              at::kByte, at::kBool, at::kComplexFloat, at::kComplexDouble}) {
          set(absl::StrCat("as ", c10::toString(dtype)), t.to(dtype));
        }
        set("= None", c10::IValue());
        set("= 3", int64_t{3});
        set("= 'tensor'", std::string("tensor"));
        set("= a list of floats", c10::List<double>({1.0, 2.0}));
        set("= {}", empty);
        for (const c10::IValue& k :
             std::vector<c10::IValue>{std::to_string(b), int64_t{-1}, int64_t{1} << 31}) {
          s.value(absl::StrCat(where, " under the key ",
                               k.isString() ? "'" + k.toStringRef() + "'" : c10::str(k.toInt())),
                  with_memory(base, key, [&](GenericDict& m) {
                    m.erase(b);
                    m.insert_or_assign(k, t);
                  }));
        }
      }
    }
    // Both warm-start memories of a bucket in another dtype or length, and the error memories swapped.
    for (int64_t b : {int64_t{0}, int64_t{1}}) {
      auto both = [&](const std::string& what,
                      const std::function<at::Tensor(const at::Tensor&)>& f) {
        c10::IValue v = base;
        for (const char* key : {"p_memory_dict", "q_memory_dict"}) {
          const at::Tensor t = entry(base, key, b);
          v = with_memory(v, key, [&](GenericDict& m) { m.insert_or_assign(b, f(t)); });
        }
        s.value(absl::StrCat("p_memory_dict[", b, "] and q_memory_dict[", b, "] ", what), v);
      };
      for (at::ScalarType dtype : {at::kDouble, at::kHalf, at::kBFloat16}) {
        both(absl::StrCat("as ", c10::toString(dtype)),
             [&](const at::Tensor& t) { return t.to(dtype); });
      }
      both("one longer", [](const at::Tensor& t) {
        return at::cat({t, at::zeros({1}, t.options())});
      });
    }
    s.value("error_dict[0] and error_dict[1] swapped",
            with_memory(base, "error_dict", [&](GenericDict& m) {
              for (int64_t b : {0, 1}) m.insert_or_assign(b, entry(base, "error_dict", 1 - b));
            }));
  });
}

// After a compressed iteration every bucket has its error and P / Q memories, and no other bucket
// has any: a memory dropped or moved to a bucket the model does not have must not be replaced by a
// fresh one (zeros, random Qs) silently. Only the hook can tell, at its first use of the state
// (load_state_dict does not know the model's buckets).
TEST(PowerSGDStateFileMutationTest, AMissingOrMovedBucketMemoryIsNotReplacedSilently) {
  sweep("PowerSGD state file, bucket memories", 10, [](const c10::IValue& base, Checker& s) {
    auto edit = [&](const std::vector<std::string>& keys,
                    const std::function<void(GenericDict&, const std::string&)>& f) {
      c10::IValue v = base;
      for (const std::string& key : keys)
        v = with_memory(v, key, [&](GenericDict& m) { f(m, key); });
      return v;
    };
    const std::vector<std::string> error = {"error_dict"},
                                   warm = {"p_memory_dict", "q_memory_dict"};
    for (const auto& [name, keys] : std::vector<std::pair<std::string, std::vector<std::string>>>{
             {"error_dict", error}, {"p_memory_dict and q_memory_dict", warm}}) {
      for (int64_t b : {int64_t{0}, int64_t{1}}) {
        auto drop = [&](GenericDict& m, const std::string&) { m.erase(b); };
        auto extra = [&](GenericDict& m, const std::string& key) {
          m.insert_or_assign(b + 7, entry(base, key, b));
        };
        auto moved = [&](GenericDict& m, const std::string& key) {
          extra(m, key);
          drop(m, key);
        };
        s.value(absl::StrCat(name, " without bucket ", b), edit(keys, drop));
        s.value(
            absl::StrCat(name, ": bucket ", b, " moved to bucket ", b + 7, " (not in the model)"),
            edit(keys, moved));
        s.value(absl::StrCat(name, ": an extra entry for bucket ", b + 7, " (not in the model)"),
                edit(keys, extra));
      }
      s.value(absl::StrCat(name, " empty"),
              edit(keys, [](GenericDict& m, const std::string&) { m.clear(); }));
    }
  });
}

}  // namespace
}  // namespace dtrain::examples
