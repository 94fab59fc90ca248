// PowerSGDState's state_dict and its checked load (powersgd_hook.h): every key's type and range,
// the settings, rank and world size against the running state's, iter against the checkpoint's
// step, the memories' values (and, in powersgd_buckets.cc, against the model's buckets).
#include <algorithm>
#include <cmath>
#include <iomanip>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "ddp_hooks/internal/powersgd_plan.h"
#include "ddp_hooks/powersgd_hook.h"

namespace dtrain::ddp_hooks {
c10::IValue PowerSGDState::state_dict() const {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("matrix_approximation_rank", matrix_approximation_rank);
  d.insert("start_powerSGD_iter", start_powerSGD_iter);
  d.insert("min_compression_rate", min_compression_rate);
  d.insert("use_error_feedback", use_error_feedback);
  d.insert("warm_start", warm_start);
  d.insert("orthogonalization_epsilon", orthogonalization_epsilon);
  d.insert("random_seed", static_cast<int64_t>(random_seed));
  d.insert("batch_tensors_with_same_shape", batch_tensors_with_same_shape);
  d.insert("iter", iter);
  d.insert("total_numel_before_compression", total_numel_before_compression);
  d.insert("total_numel_after_compression", total_numel_after_compression);
  auto tensors = [](const std::map<int64_t, at::Tensor>& m) {
    c10::impl::GenericDict out(c10::IntType::get(), c10::TensorType::get());
    for (const auto& [k, v] : m) out.insert(k, v.device().is_cpu() ? v.clone() : v.cpu());
    return out;
  };
  d.insert("error_dict", tensors(error_dict));
  d.insert("p_memory_dict", tensors(p_memory_dict));
  d.insert("q_memory_dict", tensors(q_memory_dict));
  std::ostringstream rng_state;
  rng_state << rng;
  d.insert("rng", rng_state.str());
  d.insert("rng_seeded", rng_seeded);
  // dtrain's: whose state this is (a per-rank state; PyTorch's __getstate__ has no such keys).
  d.insert("rank", static_cast<int64_t>(group.is_member() ? group.rank() : -1));
  d.insert("world_size", static_cast<int64_t>(group.is_member() ? group.size() : 0));
  return d;
}

namespace {

constexpr int64_t kMaxIter = 1'000'000'000'000;   // examples:train's bound on a step
constexpr int64_t kMaxNumel = int64_t{1} << 62;   // the compression counters
constexpr int64_t kMaxBucket = int64_t{1} << 31;  // bucket indices
constexpr size_t kMaxRngChars = 1 << 14;          // std::mt19937_64 writes about 6,600

// Every key state_dict() writes, and no other.
constexpr const char* kStateKeys[] = {"matrix_approximation_rank",
                                      "start_powerSGD_iter",
                                      "min_compression_rate",
                                      "use_error_feedback",
                                      "warm_start",
                                      "orthogonalization_epsilon",
                                      "random_seed",
                                      "batch_tensors_with_same_shape",
                                      "iter",
                                      "total_numel_before_compression",
                                      "total_numel_after_compression",
                                      "error_dict",
                                      "p_memory_dict",
                                      "q_memory_dict",
                                      "rng",
                                      "rng_seeded",
                                      "rank",
                                      "world_size"};

absl::Status malformed(const std::string& what) {
  return absl::DataLossError(
      absl::StrCat(what,
                   "; it is not a PowerSGDState::state_dict() written by this program, or it "
                   "is damaged: start without this hook state"));
}

absl::Status differs(const char* key, const std::string& saved, const std::string& running) {
  return absl::InvalidArgumentError(absl::StrCat(
      "'", key, "' is ", saved, " in the checkpoint but ", running,
      " in this run's PowerSGDState; construct the state with the settings the checkpoint was "
      "written with (a "
      "PowerSGD state is resumed, not reconfigured), or start without its hook state"));
}

// A memory of NaN or inf: PyTorch's hook adds the error memory to the gradients and
// orthogonalises the Q memory (non-finite numbers spread to the whole bucket); it overwrites the P
// memory before reading it, but no run of finite gradients writes a non-finite one.
absl::Status finite(const std::string& where, const at::Tensor& t) {
  const at::Tensor bad = at::logical_not(at::isfinite(t));
  if (!bad.any().item<bool>()) return absl::OkStatus();
  const int64_t at_index = at::nonzero(bad)[0][0].item<int64_t>();
  const double v = t[at_index].item<double>();
  return malformed(absl::StrCat(where, " holds ", std::isnan(v) ? "NaN" : (v > 0 ? "inf" : "-inf"),
                                " at index ", at_index, " of ", t.numel(),
                                ", expected finite numbers (the hook would train NaN from it)"));
}

// `s` with anything but printable ASCII as \xNN: a key from the file stays on one line.
std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s.substr(0, 80)) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += absl::StrCat("\\x", absl::Hex(c, absl::kZeroPad2));
    }
  }
  return out;
}

std::string exact(double v) {
  std::ostringstream out;
  out << std::setprecision(17) << v;
  return out.str();
}
const char* bool_name(bool b) { return b ? "true" : "false"; }

// The fields of one state_dict() (every key present: checked first), each problem one Status
// naming the key, what was found and what was expected.
class Fields {
 public:
  explicit Fields(c10::impl::GenericDict d) : d_(std::move(d)) {}

  absl::StatusOr<c10::IValue> get(const char* key, bool (c10::IValue::*is)() const,
                                  const char* type) const {
    c10::IValue v = d_.at(c10::IValue(std::string(key)));
    if (!(v.*is)())
      return malformed(absl::StrCat("'", key, "' is a ", v.tagKind(), ", expected ", type));
    return v;
  }
  absl::StatusOr<int64_t> integer(const char* key, int64_t lo, int64_t hi) const {
    absl::StatusOr<c10::IValue> v = get(key, &c10::IValue::isInt, "an int");
    if (!v.ok()) return v.status();
    const int64_t x = v->toInt();
    if (x < lo || x > hi)
      return malformed(
          absl::StrCat("'", key, "' is ", x, ", expected an int in [", lo, ", ", hi, "]"));
    return x;
  }
  // Settings: each must equal this run's.
  absl::Status same_int(const char* key, int64_t running) const {
    absl::StatusOr<c10::IValue> v = get(key, &c10::IValue::isInt, "an int");
    if (!v.ok()) return v.status();
    return v->toInt() == running ? absl::OkStatus()
                                 : differs(key, absl::StrCat(v->toInt()), absl::StrCat(running));
  }
  absl::Status same_bool(const char* key, bool running) const {
    absl::StatusOr<c10::IValue> v = get(key, &c10::IValue::isBool, "a bool");
    if (!v.ok()) return v.status();
    return v->toBool() == running ? absl::OkStatus()
                                  : differs(key, bool_name(v->toBool()), bool_name(running));
  }
  absl::Status same_double(const char* key, double running) const {
    const c10::IValue v = d_.at(c10::IValue(std::string(key)));
    if (!v.isDouble() && !v.isInt())
      return malformed(absl::StrCat("'", key, "' is a ", v.tagKind(), ", expected a float"));
    const double x = v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
    return x == running ? absl::OkStatus() : differs(key, exact(x), exact(running));  // NaN differs
  }
  // {bucket index: 1-D floating-point tensor}, as CPU copies.
  absl::StatusOr<std::map<int64_t, at::Tensor>> tensors(const char* key) const {
    absl::StatusOr<c10::IValue> v =
        get(key, &c10::IValue::isGenericDict, "a dict {bucket index: tensor}");
    if (!v.ok()) return v.status();
    std::map<int64_t, at::Tensor> out;
    for (const auto& kv : v->toGenericDict()) {
      if (!kv.key().isInt() || kv.key().toInt() < 0 || kv.key().toInt() >= kMaxBucket) {
        return malformed(
            absl::StrCat("'", key, "' has a key ",
                         kv.key().isInt() ? absl::StrCat(kv.key().toInt()) : kv.key().tagKind(),
                         ", expected bucket indices (ints in [0, ", kMaxBucket, "))"));
      }
      const std::string where = absl::StrCat("'", key, "'[", kv.key().toInt(), "]");
      if (!kv.value().isTensor())
        return malformed(
            absl::StrCat(where, " is a ", kv.value().tagKind(), ", expected a tensor"));
      const at::Tensor t = kv.value().toTensor();
      if (!t.defined() || t.layout() != at::kStrided ||
          !(t.device().is_cpu() || t.device().is_cuda()) || t.dim() != 1) {
        const std::string found =
            t.defined() ? c10::str(t.dim(), "-D ", t.layout(), " tensor on ", t.device())
                        : "undefined tensor";
        return malformed(
            absl::StrCat(where, " is a ", found,
                         ", expected a 1-D strided CPU tensor (a bucket's flat memory)"));
      }
      const at::ScalarType dtype = t.scalar_type();
      if (dtype != at::kDouble && dtype != at::kFloat && dtype != at::kHalf &&
          dtype != at::kBFloat16) {
        return malformed(
            absl::StrCat(where, " is a ", c10::toString(dtype),
                         " tensor, expected Double, Float, Half or BFloat16 (a bucket's dtype)"));
      }
      at::Tensor copy = t.detach().cpu().clone(at::MemoryFormat::Contiguous);
      if (absl::Status s = finite(where, copy); !s.ok()) return s;
      out.emplace(kv.key().toInt(), std::move(copy));
    }
    return out;
  }
  // std::mt19937_64 as state_dict() writes it: 312 words and an index, nothing else.
  absl::StatusOr<std::mt19937_64> rng() const {
    absl::StatusOr<c10::IValue> v = get("rng", &c10::IValue::isString, "a str");
    if (!v.ok()) return v.status();
    const std::string& text = v->toStringRef();
    if (text.size() > kMaxRngChars) {
      return malformed(absl::StrCat("'rng' has ", text.size(),
                                    " characters, expected a std::mt19937_64 state of at most ",
                                    kMaxRngChars));
    }
    std::istringstream in(text);
    std::mt19937_64 parsed;
    in >> parsed;
    const bool ok = !in.fail() && (in >> std::ws).eof();  // all of it, and nothing else
    if (!ok)
      return malformed(
          "'rng' is not a std::mt19937_64 state (312 numbers and an index, as state_dict() writes "
          "it)");
    return parsed;
  }

 private:
  c10::impl::GenericDict d_;
};

// A state_dict() checked field by field, not yet committed.
struct Loaded {
  int64_t iter = 0, before = 0, after = 0;
  std::map<int64_t, at::Tensor> error, p_memory, q_memory;
  std::mt19937_64 rng;
  bool rng_seeded = false;
};

// Exactly the keys state_dict() writes; a file of an older dtrain lacks only 'rank' and
// 'world_size'.
absl::Status check_keys(const c10::impl::GenericDict& d) {
  auto has = [&](const char* key) { return d.contains(c10::IValue(std::string(key))); };
  if (!has("rank") && !has("world_size") && d.size() + 2 == std::size(kStateKeys) &&
      has("error_dict")) {
    return absl::InvalidArgumentError(
        "it records no 'rank' and 'world_size' (a file written before dtrain recorded whose state "
        "it is), so it cannot be told from another rank's or another world size's hook state; "
        "resume it with the dtrain that wrote it, or start without its hook state");
  }
  for (const char* key : kStateKeys) {
    if (!has(key)) return malformed(absl::StrCat("it has no '", key, "'"));
  }
  for (const auto& kv : d) {
    const bool known = kv.key().isString() &&
                       std::any_of(std::begin(kStateKeys), std::end(kStateKeys),
                                   [&](const char* k) { return kv.key().toStringRef() == k; });
    if (!known) {
      return malformed(
          absl::StrCat("it has the key ",
                       kv.key().isString() ? printable(kv.key().toStringRef()) : kv.key().tagKind(),
                       ", expected only the ", std::size(kStateKeys), " keys state_dict() writes"));
    }
  }
  return absl::OkStatus();
}

// 'rank' and 'world_size' against the running state's group: a per-rank state.
absl::Status check_owner(const Fields& f, const comm::Group& group) {
  const int64_t rank = group.is_member() ? group.rank() : -1,
                world = group.is_member() ? group.size() : 0;
  absl::StatusOr<int64_t> saved_world = f.integer("world_size", 1, kMaxBucket);
  if (!saved_world.ok()) return saved_world.status();
  absl::StatusOr<int64_t> saved_rank = f.integer("rank", 0, *saved_world - 1);
  if (!saved_rank.ok()) return saved_rank.status();
  if (*saved_world != world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'world_size' is ", *saved_world, ", but this run has ", world,
        " ranks: it was written by a job of another size, whose per-rank hook states do not "
        "carry over; resume at ",
        *saved_world, " ranks, or start without its hook state"));
  }
  if (*saved_rank != rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'rank' is ", *saved_rank, ", but this is rank ", rank,
        ": it is another rank's hook state (copied or renamed?); each rank resumes from the "
        "file it wrote (hook-rank<R>.pt), or start without its hook state"));
  }
  return absl::OkStatus();
}

// What the hook can have kept with these settings by this iteration.
absl::Status check_kept(const PowerSGDState& s, const Loaded& l) {
  if (!s.use_error_feedback && !l.error.empty()) {
    return malformed(absl::StrCat("'error_dict' has ", l.error.size(),
                                  " entries, expected none: use_error_feedback is false"));
  }
  if (!s.warm_start && (!l.p_memory.empty() || !l.q_memory.empty())) {
    return malformed(absl::StrCat("'p_memory_dict' and 'q_memory_dict' have ", l.p_memory.size(),
                                  " and ", l.q_memory.size(),
                                  " entries, expected none: warm_start is false"));
  }
  // Warm start keeps a P and a Q memory for every bucket it compressed, in the bucket's dtype.
  for (const auto& [mine, other, key, other_key] :
       {std::tuple(&l.p_memory, &l.q_memory, "p_memory_dict", "q_memory_dict"),
        std::tuple(&l.q_memory, &l.p_memory, "q_memory_dict", "p_memory_dict")}) {
    for (const auto& [b, t] : *mine) {
      auto it = other->find(b);
      if (it == other->end()) {
        return malformed(absl::StrCat("'", key, "'[", b, "] has no '", other_key, "'[", b,
                                      "] beside it, expected both memories of every bucket "
                                      "(warm start keeps them together)"));
      }
      if (it->second.scalar_type() != t.scalar_type()) {
        return malformed(absl::StrCat("'", key, "'[", b, "] is ", c10::toString(t.scalar_type()),
                                      " but '", other_key, "'[", b, "] ",
                                      c10::toString(it->second.scalar_type()),
                                      ", expected both in the bucket's dtype"));
      }
    }
  }
  // The hook compresses from iteration start_powerSGD_iter on: before it has run one, it keeps
  // and counts nothing.
  if (l.iter <= s.start_powerSGD_iter &&
      (!l.error.empty() || !l.p_memory.empty() || l.before != 0)) {
    return malformed(absl::StrCat(
        "'iter' is ", l.iter, ", not after start_powerSGD_iter ", s.start_powerSGD_iter,
        " (no compressed iteration yet), but the state holds ", l.error.size(),
        " 'error_dict' and ", l.p_memory.size(),
        " 'p_memory_dict' entries and 'total_numel_before_compression' ", l.before,
        "; expected none of them: the hook keeps and counts nothing before it compresses"));
  }
  return absl::OkStatus();
}

// Every field of `state_dict`, checked; nothing of `s` changes.
absl::StatusOr<Loaded> parse(const PowerSGDState& s, const c10::IValue& state_dict,
                             const PowerSGDExpected& expected) {
  if (!state_dict.isGenericDict())
    return malformed(absl::StrCat("it is a ", state_dict.tagKind(), ", expected a dict"));
  const c10::impl::GenericDict d = state_dict.toGenericDict();
  if (absl::Status st = check_keys(d); !st.ok()) return st;
  const Fields f(d);
  for (const absl::Status& st :
       {f.same_int("matrix_approximation_rank", s.matrix_approximation_rank),
        f.same_int("start_powerSGD_iter", s.start_powerSGD_iter),
        f.same_double("min_compression_rate", s.min_compression_rate),
        f.same_bool("use_error_feedback", s.use_error_feedback),
        f.same_bool("warm_start", s.warm_start),
        f.same_double("orthogonalization_epsilon", s.orthogonalization_epsilon),
        f.same_int("random_seed", static_cast<int64_t>(s.random_seed)),
        f.same_bool("batch_tensors_with_same_shape", s.batch_tensors_with_same_shape),
        check_owner(f, s.group)}) {
    if (!st.ok()) return st;
  }
  Loaded l;
  absl::StatusOr<int64_t> iter = f.integer("iter", 0, kMaxIter);
  if (!iter.ok()) return iter.status();
  if (expected.iter.has_value() && *iter != *expected.iter) {
    return absl::InvalidArgumentError(
        absl::StrCat("'iter' is ", *iter, ", expected ", *expected.iter,
                     " (the iteration the checkpoint was written at); the hook state belongs to "
                     "another step or run: resume "
                     "from the step directory it was written in, or start without its hook state"));
  }
  l.iter = *iter;
  absl::StatusOr<int64_t> before = f.integer("total_numel_before_compression", 0, kMaxNumel);
  if (!before.ok()) return before.status();
  l.before = *before;
  absl::StatusOr<int64_t> after = f.integer("total_numel_after_compression", 0, l.before);
  if (!after.ok()) return after.status();
  l.after = *after;
  for (const auto& [key, out] :
       {std::pair("error_dict", &l.error), std::pair("p_memory_dict", &l.p_memory),
        std::pair("q_memory_dict", &l.q_memory)}) {
    absl::StatusOr<std::map<int64_t, at::Tensor>> m = f.tensors(key);
    if (!m.ok()) return m.status();
    *out = *std::move(m);
  }
  absl::StatusOr<std::mt19937_64> rng = f.rng();
  if (!rng.ok()) return rng.status();
  l.rng = *rng;
  absl::StatusOr<c10::IValue> seeded = f.get("rng_seeded", &c10::IValue::isBool, "a bool");
  if (!seeded.ok()) return seeded.status();
  l.rng_seeded = seeded->toBool();
  if (absl::Status st = check_kept(s, l); !st.ok()) return st;
  if (expected.buckets.has_value()) {
    absl::Status st =
        internal::check_memories(s, l.iter, l.error, l.p_memory, l.q_memory, *expected.buckets);
    if (!st.ok()) return st;
  }
  return l;
}

// `st` as the one line a caller shows: what, which file, then what is wrong.
absl::Status named(const absl::Status& st, const std::string& file) {
  if (st.ok()) return st;
  return absl::Status(st.code(),
                      absl::StrCat(file.empty() ? "PowerSGD state: "
                                                : absl::StrCat("PowerSGD state file ", file, ": "),
                                   st.message()));
}

}  // namespace

absl::Status PowerSGDState::check_state_dict(const c10::IValue& state_dict,
                                             const PowerSGDExpected& expected) const {
  return named(parse(*this, state_dict, expected).status(), expected.file);
}

absl::Status PowerSGDState::load_state_dict(const c10::IValue& state_dict,
                                            const PowerSGDExpected& expected) {
  absl::StatusOr<Loaded> l = parse(*this, state_dict, expected);
  if (!l.ok()) return named(l.status(), expected.file);
  // Everything checked: commit.
  iter = l->iter;
  total_numel_before_compression = l->before;
  total_numel_after_compression = l->after;
  error_dict = std::move(l->error);
  p_memory_dict = std::move(l->p_memory);
  q_memory_dict = std::move(l->q_memory);
  unchecked_error_buckets.clear();
  unchecked_memory_buckets.clear();
  for (const auto& kv : error_dict) unchecked_error_buckets.insert(kv.first);
  for (const auto& kv : p_memory_dict) unchecked_memory_buckets.insert(kv.first);
  check_loaded_buckets = iter > start_powerSGD_iter && (use_error_feedback || warm_start);
  rng = l->rng;
  rng_seeded = l->rng_seeded;
  return absl::OkStatus();
}

absl::Status PowerSGDState::load_state_dict(const c10::IValue& state_dict,
                                            std::optional<int64_t> expected_iter) {
  return load_state_dict(state_dict, PowerSGDExpected{.iter = expected_iter});
}

void PowerSGDState::load_state_dict(const c10::IValue& state_dict) {
  const absl::Status s = load_state_dict(state_dict, std::nullopt);
  TORCH_CHECK(s.ok(), std::string(s.message()));
}

}  // namespace dtrain::ddp_hooks
