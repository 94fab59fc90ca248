// Property: whatever happens to a PowerSGD hook state file (examples:train's hook-rank<r>.pt) --
// bytes flipped, cut, overwritten or appended, or a checksum-valid file with changed fields
// (settings, iter, counters, the RNG state, rank, world size, the memories' shapes, dtypes, values,
// types and keys, keys dropped or added, another rank's file) -- resuming from it is refused at
// load, by a Status from checkpoint::load_state or PowerSGDState::load_state_dict (given the
// model's buckets, as examples:train gives them), on the rank that reads it and before any
// collective: the ranks agree on the verdict first, so one rank's bad file never leaves the other
// inside a collective (it used to: a memory of another length was found by the hook at its first
// use, and Gloo aborted rank 0); or it trains the same next step as the original file: the same
// averaged gradients and error / P / Q memories. Never a crash, an internal assert, NaN or a
// silently different step. The files: both ranks' states after two ranks (threads) ran PowerSGD
// (rank 1, from iteration 2) on two buckets for 5 iterations (3 compressed); rank 0 resumes the
// mutant, rank 1 its own file, and the next step runs on both. The machinery (the model, the
// checker, the edits) is in powersgd_state_mutation_checker.h.
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/state_file.h"
#include "examples/powersgd_state_mutation_checker.h"

namespace dtrain::examples::mutation {
namespace {

void damaged_bytes(Checker& s) {
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
}

void fields_changed(const c10::IValue& base, Checker& s) {
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
  for (const auto& item : base.toGenericDict()) {  // all 18
    const std::string key = item.key().toStringRef();
    for (const auto& [name, v] : odd) {
      if (key == "error_dict" && name == "{}") continue;  // no memory at all: the other test's case
      s.value(absl::StrCat(key, " = ", name), with(base, key, v));
    }
    s.value(absl::StrCat("no ", key), with(base, key, c10::IValue(), /*drop=*/true));
  }
  // Integers near and far from the saved ones (settings, iter, the counters).
  for (const char* key :
       {"matrix_approximation_rank", "start_powerSGD_iter", "random_seed", "iter",
        "total_numel_before_compression", "total_numel_after_compression", "rank", "world_size"}) {
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
}

void rng_texts_changed(const c10::IValue& base, Checker& s) {
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
}

void memories_changed(const c10::IValue& base, Checker& s) {
  const GenericDict empty(c10::StringType::get(), c10::AnyType::get());
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
}

void warm_start_memories_changed(const c10::IValue& base, Checker& s) {
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
}

TEST(PowerSGDStateFileMutationTest, EveryMutantIsRefusedOrTrainsTheSameNextStep) {
  sweep("PowerSGD state file", 500, [](const c10::IValue& base, Checker& s) {
    // The comparison can fail: a memory with other numbers loads and trains another step.
    ASSERT_TRUE(s.write("control", with_memory(base, "error_dict", [&](GenericDict& m) {
                          m.insert_or_assign(int64_t{0}, entry(base, "error_dict", 0) * 2);
                        })));
    const Outcome control = s.check("control: error_dict[0] doubled");
    if (s.leader()) EXPECT_EQ(name(control), std::string(name(Outcome::kDifferent)));
    damaged_bytes(s);
    fields_changed(base, s);
    rng_texts_changed(base, s);
    memories_changed(base, s);
    warm_start_memories_changed(base, s);
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

// The outside campaign's hostile files and more, each checksum-valid: every memory (error, P, Q)
// of each bucket of another length, one number too many or too few, empty, in float64, half or
// bfloat16, with a NaN, inf or -inf, missing, or for a bucket the model does not have; P and Q
// both in float64; an all-zero Q (orthogonalization_epsilon 0: the next step would divide by
// zero); the error memories of the two buckets swapped; rank 1's file on rank 0, a forged rank,
// another world size, a file without rank and world size. Each must be refused at load on rank 0,
// before any collective, in one line naming the file, the key and the bucket; rank 1 (its own
// file, accepted) follows the agreed verdict. Then two legal states (powersgd_hook.h): all-zero
// error memories (PyTorch's state after a reset) train another, finite step; an all-zero P
// memory (overwritten before it is read) the same step.
TEST(PowerSGDStateFileMutationTest, HostileHookFilesAreRefusedAtLoadNamingFileKeyAndBucket) {
  sweep("PowerSGD hook files, hostile", 0, [](const c10::IValue& base, Checker& s) {
    const double inf = std::numeric_limits<double>::infinity();
    for (const std::string key : {"error_dict", "p_memory_dict", "q_memory_dict"}) {
      for (int64_t b : {int64_t{0}, int64_t{1}}) {
        const at::Tensor t = entry(base, key, b);
        const int64_t n = t.numel();
        const std::string where = absl::StrCat("'", key, "'[", b, "]");
        auto set = [&](const std::string& what, const at::Tensor& v) {
          s.hostile(absl::StrCat(key, "[", b, "] ", what),
                    with_memory(base, key, [&](GenericDict& m) { m.insert_or_assign(b, v); }),
                    where);
        };
        set("of 5 numbers", at::zeros({5}));
        set("one number too many", at::cat({t, at::zeros({1})}));
        set("one number too few", t.narrow(0, 0, n - 1).clone());
        set("empty", at::empty({0}));
        for (at::ScalarType dtype : {at::kDouble, at::kHalf, at::kBFloat16})
          set(absl::StrCat("as ", c10::toString(dtype)), t.to(dtype));
        for (const auto& [value, what] : std::vector<std::pair<double, std::string>>{
                 {std::nan(""), "NaN"}, {inf, "inf"}, {-inf, "-inf"}}) {
          at::Tensor v = t.clone();
          v[n / 2] = value;
          set(absl::StrCat("with a ", what), v);
        }
        s.hostile(
            absl::StrCat(key, " without bucket ", b),
            with_memory(base, key, [&](GenericDict& m) { m.erase(b); }),
            key == "error_dict" ? absl::StrCat("'error_dict' has no entry for bucket ", b) : where);
      }
      s.hostile(
          absl::StrCat(key, " with bucket 1's entry also for bucket 2 (not in the model)"),
          with_memory(base, key,
                      [&](GenericDict& m) { m.insert_or_assign(int64_t{2}, entry(base, key, 1)); }),
          absl::StrCat("'", key, "'[2]"));
    }
    for (int64_t b : {int64_t{0}, int64_t{1}}) {
      c10::IValue v = base;
      for (const char* key : {"p_memory_dict", "q_memory_dict"}) {
        const at::Tensor t = entry(base, key, b).to(at::kDouble);
        v = with_memory(v, key, [&](GenericDict& m) { m.insert_or_assign(b, t); });
      }
      s.hostile(absl::StrCat("p_memory_dict[", b, "] and q_memory_dict[", b, "] as Double"), v,
                absl::StrCat("'p_memory_dict'[", b, "]"));
      s.hostile(absl::StrCat("q_memory_dict[", b, "] all zeros"),
                with_memory(base, "q_memory_dict",
                            [&](GenericDict& m) {
                              m.insert_or_assign(b,
                                                 at::zeros_like(entry(base, "q_memory_dict", b)));
                            }),
                absl::StrCat("'q_memory_dict'[", b, "]"));
    }
    s.hostile("error_dict[0] and error_dict[1] swapped",
              with_memory(base, "error_dict",
                          [&](GenericDict& m) {
                            for (int64_t b : {0, 1})
                              m.insert_or_assign(b, entry(base, "error_dict", 1 - b));
                          }),
              "'error_dict'[0]");
    absl::StatusOr<c10::IValue> rank1 = checkpoint::load_state(original_file(1));
    ASSERT_TRUE(rank1.ok()) << rank1.status();
    s.hostile("rank 1's hook-rank1.pt copied over rank 0's", *rank1, "'rank' is 1");
    s.hostile("rank 0's file with 'rank' 1", with(base, "rank", int64_t{1}), "'rank' is 1");
    s.hostile("rank 0's file with 'world_size' 3", with(base, "world_size", int64_t{3}),
              "'world_size' is 3");
    s.hostile("rank 0's file with 'world_size' 1", with(base, "world_size", int64_t{1}),
              "'world_size' is 1");
    s.hostile("a file without 'rank' and 'world_size' (written before dtrain recorded them)",
              with(with(base, "rank", c10::IValue(), true), "world_size", c10::IValue(), true),
              "no 'rank' and 'world_size'");
    s.legal("error_dict[0] all zeros",
            with_memory(base, "error_dict",
                        [&](GenericDict& m) {
                          m.insert_or_assign(int64_t{0},
                                             at::zeros_like(entry(base, "error_dict", 0)));
                        }),
            Outcome::kDifferent);
    s.legal("p_memory_dict[0] all zeros",
            with_memory(base, "p_memory_dict",
                        [&](GenericDict& m) {
                          m.insert_or_assign(int64_t{0},
                                             at::zeros_like(entry(base, "p_memory_dict", 0)));
                        }),
            Outcome::kIdentical);
    if (!s.leader()) return;
    s.report_hostile("PowerSGD hook files, hostile");
    EXPECT_GE(s.hostile_files(), 60);
    EXPECT_EQ(s.hostile_refused(), s.hostile_files());
  });
}

}  // namespace
}  // namespace dtrain::examples::mutation
