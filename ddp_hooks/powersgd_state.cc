// PowerSGDState's state_dict and its checked load (powersgd_hook.h): every key's type and range,
// the settings against the running state's, iter against the checkpoint's step.
#include <algorithm>
#include <iomanip>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
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
                                      "rng_seeded"};

absl::Status malformed(const std::string& what) {
  return absl::DataLossError(
      absl::StrCat("PowerSGD state: ", what,
                   "; it is not a PowerSGDState::state_dict() written by this program, or it "
                   "is damaged: start without this hook state"));
}

absl::Status differs(const char* key, const std::string& saved, const std::string& running) {
  return absl::InvalidArgumentError(absl::StrCat(
      "PowerSGD state: '", key, "' is ", saved, " in the checkpoint but ", running,
      " in this run's PowerSGDState; construct the state with the settings the checkpoint was "
      "written with (a "
      "PowerSGD state is resumed, not reconfigured), or start without its hook state"));
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
      out.emplace(kv.key().toInt(), t.detach().cpu().clone(at::MemoryFormat::Contiguous));
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

}  // namespace

absl::Status PowerSGDState::load_state_dict(const c10::IValue& state_dict,
                                            std::optional<int64_t> expected_iter) {
  if (!state_dict.isGenericDict())
    return malformed(absl::StrCat("it is a ", state_dict.tagKind(), ", expected a dict"));
  const c10::impl::GenericDict d = state_dict.toGenericDict();
  for (const char* key : kStateKeys) {
    if (!d.contains(c10::IValue(std::string(key))))
      return malformed(absl::StrCat("it has no '", key, "'"));
  }
  for (const auto& kv : d) {
    const bool known = kv.key().isString() &&
                       std::any_of(std::begin(kStateKeys), std::end(kStateKeys),
                                   [&](const char* k) { return kv.key().toStringRef() == k; });
    if (!known) {
      return malformed(absl::StrCat(
          "it has the key ",
          kv.key().isString() ? kv.key().toStringRef().substr(0, 80) : kv.key().tagKind(),
          ", expected only the ", std::size(kStateKeys), " keys state_dict() writes"));
    }
  }
  const Fields f(d);
  for (const absl::Status& s :
       {f.same_int("matrix_approximation_rank", matrix_approximation_rank),
        f.same_int("start_powerSGD_iter", start_powerSGD_iter),
        f.same_double("min_compression_rate", min_compression_rate),
        f.same_bool("use_error_feedback", use_error_feedback),
        f.same_bool("warm_start", warm_start),
        f.same_double("orthogonalization_epsilon", orthogonalization_epsilon),
        f.same_int("random_seed", static_cast<int64_t>(random_seed)),
        f.same_bool("batch_tensors_with_same_shape", batch_tensors_with_same_shape)}) {
    if (!s.ok()) return s;
  }
  absl::StatusOr<int64_t> saved_iter = f.integer("iter", 0, kMaxIter);
  if (!saved_iter.ok()) return saved_iter.status();
  if (expected_iter.has_value() && *saved_iter != *expected_iter) {
    return absl::InvalidArgumentError(
        absl::StrCat("PowerSGD state: 'iter' is ", *saved_iter, ", expected ", *expected_iter,
                     " (the iteration the checkpoint was written at); the hook state belongs to "
                     "another step or run: resume "
                     "from the step directory it was written in, or start without its hook state"));
  }
  absl::StatusOr<int64_t> before = f.integer("total_numel_before_compression", 0, kMaxNumel);
  if (!before.ok()) return before.status();
  absl::StatusOr<int64_t> after = f.integer("total_numel_after_compression", 0, *before);
  if (!after.ok()) return after.status();
  absl::StatusOr<std::map<int64_t, at::Tensor>> error = f.tensors("error_dict");
  if (!error.ok()) return error.status();
  absl::StatusOr<std::map<int64_t, at::Tensor>> p_memory = f.tensors("p_memory_dict");
  if (!p_memory.ok()) return p_memory.status();
  absl::StatusOr<std::map<int64_t, at::Tensor>> q_memory = f.tensors("q_memory_dict");
  if (!q_memory.ok()) return q_memory.status();
  absl::StatusOr<std::mt19937_64> saved_rng = f.rng();
  if (!saved_rng.ok()) return saved_rng.status();
  absl::StatusOr<c10::IValue> seeded = f.get("rng_seeded", &c10::IValue::isBool, "a bool");
  if (!seeded.ok()) return seeded.status();
  // What the hook can have kept with these settings at this iteration.
  if (!use_error_feedback && !error->empty()) {
    return malformed(absl::StrCat("'error_dict' has ", error->size(),
                                  " entries, expected none: use_error_feedback is false"));
  }
  if (!warm_start && (!p_memory->empty() || !q_memory->empty())) {
    return malformed(absl::StrCat("'p_memory_dict' and 'q_memory_dict' have ", p_memory->size(),
                                  " and ", q_memory->size(),
                                  " entries, expected none: warm_start is false"));
  }
  const bool paired =
      p_memory->size() == q_memory->size() &&
      std::all_of(p_memory->begin(), p_memory->end(), [&](const auto& p) {
        auto q = q_memory->find(p.first);
        return q != q_memory->end() && q->second.scalar_type() == p.second.scalar_type();
      });
  if (!paired) {
    return malformed(
        "'p_memory_dict' and 'q_memory_dict' differ in their buckets or dtypes, expected both "
        "memories "
        "of every bucket, in one dtype");
  }
  if (*saved_iter < start_powerSGD_iter &&
      (!error->empty() || !p_memory->empty() || *before != 0)) {
    return malformed(absl::StrCat(
        "'iter' is ", *saved_iter, ", before start_powerSGD_iter ", start_powerSGD_iter,
        ", but the state holds ", error->size(), " 'error_dict' and ", p_memory->size(),
        " 'p_memory_dict' entries and 'total_numel_before_compression' ", *before,
        "; expected none of them: the hook keeps and counts nothing before it compresses"));
  }
  // Everything checked: commit.
  iter = *saved_iter;
  total_numel_before_compression = *before;
  total_numel_after_compression = *after;
  error_dict = *std::move(error);
  p_memory_dict = *std::move(p_memory);
  q_memory_dict = *std::move(q_memory);
  unchecked_error_buckets.clear();
  unchecked_memory_buckets.clear();
  for (const auto& kv : error_dict) unchecked_error_buckets.insert(kv.first);
  for (const auto& kv : p_memory_dict) unchecked_memory_buckets.insert(kv.first);
  check_loaded_buckets = iter > start_powerSGD_iter && (use_error_feedback || warm_start);
  rng = *saved_rng;
  rng_seeded = seeded->toBool();
  return absl::OkStatus();
}

void PowerSGDState::load_state_dict(const c10::IValue& state_dict) {
  const absl::Status s = load_state_dict(state_dict, std::nullopt);
  TORCH_CHECK(s.ok(), std::string(s.message()));
}

}  // namespace dtrain::ddp_hooks
