#include "ddp_hooks/powersgd_hook.h"

#include <algorithm>
#include <cstddef>
#include <iomanip>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "ddp_hooks/default_hooks.h"

namespace dtrain::ddp_hooks {
namespace {

c10::intrusive_ptr<c10::ivalue::Future> done(const at::Tensor& t) {
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  fut->markCompleted(c10::IValue(t));
  return fut;
}

// LibTorch's CPU kernels lack half-precision bmm (and norms): compute those in fp32 and store
// the result in the tensor's own dtype (the fp16 wrapper hands PowerSGD half buckets).
bool reduced_on_cpu(const at::Tensor& t) {
  return t.device().is_cpu() && (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16);
}

void bmm_into(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (reduced_on_cpu(out)) {
    out.copy_(at::bmm(a.to(at::kFloat), b.to(at::kFloat)));
  } else {
    at::bmm_out(out, a, b);
  }
}

void allreduce(const comm::Group& group, at::Tensor& t) {
  if (t.numel() == 0) return;
  allreduce_sum(group, t)->waitAndThrow();  // float16 on a Gloo that cannot reduce it: gathered
}

// The first use of what load_state_dict brought in for bucket `index`: the checkpoint cannot say
// which model it was written for, so each tensor must fit the bucket (before any collective: a
// misfit fails here, not as a silent re-randomisation or a broadcast add); then it moves to the
// bucket's device.
void adopt_loaded(PowerSGDState& s, int64_t index, const at::Tensor& input, int64_t ps_size, int64_t qs_size) {
  auto fit = [&](std::map<int64_t, at::Tensor>& dict, const char* key, int64_t numel) {
    auto it = dict.find(index);
    if (it == dict.end()) return;
    const at::Tensor& t = it->second;
    TORCH_CHECK(t.numel() == numel && t.scalar_type() == input.scalar_type(), "PowerSGDHook: the loaded state's '",
                key, "'[", index, "] holds ", t.numel(), " ", t.scalar_type(), " numbers but bucket ", index, " needs ",
                numel, " ", input.scalar_type(), "; the checkpoint was written for another model, bucket layout "
                "(bucket_cap_mb) or precision: resume with the settings it was written with, or start without its hook "
                "state");
    it->second = t.to(input.device(), input.scalar_type());
  };
  if (s.unchecked_error_buckets.count(index) > 0) fit(s.error_dict, "error_dict", input.numel());
  if (s.unchecked_memory_buckets.count(index) > 0) {
    fit(s.p_memory_dict, "p_memory_dict", ps_size);
    fit(s.q_memory_dict, "q_memory_dict", qs_size);
  }
  s.unchecked_error_buckets.erase(index);  // checked (a misfit threw above, leaving them unchecked)
  s.unchecked_memory_buckets.erase(index);
}

}  // namespace

void orthogonalize(at::Tensor& matrices, double epsilon) {
  TORCH_CHECK(matrices.dim() == 3 && matrices.size(2) <= matrices.size(1), "orthogonalize expects b x n x r with r <= n");
  if (reduced_on_cpu(matrices)) {
    at::Tensor wide = matrices.to(at::kFloat);
    orthogonalize(wide, epsilon);
    matrices.copy_(wide);
    return;
  }
  const int64_t cols = matrices.size(2);
  for (int64_t i = 0; i < cols; ++i) {
    at::Tensor col = matrices.narrow(2, i, 1);
    at::Tensor norm = at::norm(col, 2, {1}, /*keepdim=*/true);
    if (epsilon == 0) {
      col.div_(norm);
    } else {
      col.div_(norm + epsilon);
    }
    if (i + 1 < cols) {
      at::Tensor rest = matrices.narrow(2, i + 1, cols - i - 1);
      rest.sub_(at::sum(col * rest, {1}, /*keepdim=*/true) * col);
    }
  }
}

void PowerSGDState::validate() const {
  TORCH_CHECK(group.is_member(), "PowerSGDState: the process group is not set or this rank is not in it");
  TORCH_CHECK(!((use_error_feedback || warm_start) && start_powerSGD_iter <= 1),
              "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled, because PowerSGD "
              "can only be applied after the first two iterations in DDP.");
  TORCH_CHECK(matrix_approximation_rank >= 1, "matrix_approximation_rank must be >= 1, got ", matrix_approximation_rank);
  TORCH_CHECK(min_compression_rate >= 1, "min_compression_rate must be >= 1, got ", min_compression_rate);
}

double PowerSGDState::compression_rate() const {
  return total_numel_after_compression == 0
             ? 1.0
             : static_cast<double>(total_numel_before_compression) / total_numel_after_compression;
}

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

constexpr int64_t kMaxIter = 1'000'000'000'000;  // examples:train's bound on a step
constexpr int64_t kMaxNumel = int64_t{1} << 62;  // the compression counters
constexpr int64_t kMaxBucket = int64_t{1} << 31;  // bucket indices
constexpr size_t kMaxRngChars = 1 << 14;          // std::mt19937_64 writes about 6,600

// Every key state_dict() writes, and no other.
constexpr const char* kStateKeys[] = {
    "matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate", "use_error_feedback",
    "warm_start", "orthogonalization_epsilon", "random_seed", "batch_tensors_with_same_shape", "iter",
    "total_numel_before_compression", "total_numel_after_compression", "error_dict", "p_memory_dict",
    "q_memory_dict", "rng", "rng_seeded"};

absl::Status malformed(const std::string& what) {
  return absl::DataLossError(absl::StrCat("PowerSGD state: ", what,
                                          "; it is not a PowerSGDState::state_dict() written by this program, or it "
                                          "is damaged: start without this hook state"));
}

absl::Status differs(const char* key, const std::string& saved, const std::string& running) {
  return absl::InvalidArgumentError(absl::StrCat(
      "PowerSGD state: '", key, "' is ", saved, " in the checkpoint but ", running,
      " in this run's PowerSGDState; construct the state with the settings the checkpoint was written with (a "
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

  absl::StatusOr<c10::IValue> get(const char* key, bool (c10::IValue::*is)() const, const char* type) const {
    c10::IValue v = d_.at(c10::IValue(std::string(key)));
    if (!(v.*is)()) return malformed(absl::StrCat("'", key, "' is a ", v.tagKind(), ", expected ", type));
    return v;
  }
  absl::StatusOr<int64_t> integer(const char* key, int64_t lo, int64_t hi) const {
    absl::StatusOr<c10::IValue> v = get(key, &c10::IValue::isInt, "an int");
    if (!v.ok()) return v.status();
    const int64_t x = v->toInt();
    if (x < lo || x > hi) return malformed(absl::StrCat("'", key, "' is ", x, ", expected an int in [", lo, ", ", hi, "]"));
    return x;
  }
  // Settings: each must equal this run's.
  absl::Status same_int(const char* key, int64_t running) const {
    absl::StatusOr<c10::IValue> v = get(key, &c10::IValue::isInt, "an int");
    if (!v.ok()) return v.status();
    return v->toInt() == running ? absl::OkStatus() : differs(key, absl::StrCat(v->toInt()), absl::StrCat(running));
  }
  absl::Status same_bool(const char* key, bool running) const {
    absl::StatusOr<c10::IValue> v = get(key, &c10::IValue::isBool, "a bool");
    if (!v.ok()) return v.status();
    return v->toBool() == running ? absl::OkStatus() : differs(key, bool_name(v->toBool()), bool_name(running));
  }
  absl::Status same_double(const char* key, double running) const {
    const c10::IValue v = d_.at(c10::IValue(std::string(key)));
    if (!v.isDouble() && !v.isInt()) return malformed(absl::StrCat("'", key, "' is a ", v.tagKind(), ", expected a float"));
    const double x = v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
    return x == running ? absl::OkStatus() : differs(key, exact(x), exact(running));  // NaN differs
  }
  // {bucket index: 1-D floating-point tensor}, as CPU copies.
  absl::StatusOr<std::map<int64_t, at::Tensor>> tensors(const char* key) const {
    absl::StatusOr<c10::IValue> v = get(key, &c10::IValue::isGenericDict, "a dict {bucket index: tensor}");
    if (!v.ok()) return v.status();
    std::map<int64_t, at::Tensor> out;
    for (const auto& kv : v->toGenericDict()) {
      if (!kv.key().isInt() || kv.key().toInt() < 0 || kv.key().toInt() >= kMaxBucket) {
        return malformed(absl::StrCat("'", key, "' has a key ", kv.key().isInt() ? absl::StrCat(kv.key().toInt()) : kv.key().tagKind(),
                                      ", expected bucket indices (ints in [0, ", kMaxBucket, "))"));
      }
      const std::string where = absl::StrCat("'", key, "'[", kv.key().toInt(), "]");
      if (!kv.value().isTensor()) return malformed(absl::StrCat(where, " is a ", kv.value().tagKind(), ", expected a tensor"));
      const at::Tensor t = kv.value().toTensor();
      if (!t.defined() || t.layout() != at::kStrided || !(t.device().is_cpu() || t.device().is_cuda()) || t.dim() != 1) {
        const std::string found = t.defined() ? c10::str(t.dim(), "-D ", t.layout(), " tensor on ", t.device()) : "undefined tensor";
        return malformed(absl::StrCat(where, " is a ", found, ", expected a 1-D strided CPU tensor (a bucket's flat memory)"));
      }
      const at::ScalarType dtype = t.scalar_type();
      if (dtype != at::kDouble && dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16) {
        return malformed(absl::StrCat(where, " is a ", c10::toString(dtype),
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
      return malformed(absl::StrCat("'rng' has ", text.size(), " characters, expected a std::mt19937_64 state of at most ",
                                    kMaxRngChars));
    }
    std::istringstream in(text);
    std::mt19937_64 parsed;
    in >> parsed;
    const bool ok = !in.fail() && (in >> std::ws).eof();  // all of it, and nothing else
    if (!ok) return malformed("'rng' is not a std::mt19937_64 state (312 numbers and an index, as state_dict() writes it)");
    return parsed;
  }

 private:
  c10::impl::GenericDict d_;
};

}  // namespace

absl::Status PowerSGDState::load_state_dict(const c10::IValue& state_dict, std::optional<int64_t> expected_iter) {
  if (!state_dict.isGenericDict()) return malformed(absl::StrCat("it is a ", state_dict.tagKind(), ", expected a dict"));
  const c10::impl::GenericDict d = state_dict.toGenericDict();
  for (const char* key : kStateKeys) {
    if (!d.contains(c10::IValue(std::string(key)))) return malformed(absl::StrCat("it has no '", key, "'"));
  }
  for (const auto& kv : d) {
    const bool known = kv.key().isString() && std::any_of(std::begin(kStateKeys), std::end(kStateKeys), [&](const char* k) {
                         return kv.key().toStringRef() == k;
                       });
    if (!known) {
      return malformed(absl::StrCat("it has the key ", kv.key().isString() ? kv.key().toStringRef().substr(0, 80) : kv.key().tagKind(),
                                    ", expected only the ", std::size(kStateKeys), " keys state_dict() writes"));
    }
  }
  const Fields f(d);
  for (const absl::Status& s : {f.same_int("matrix_approximation_rank", matrix_approximation_rank),
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
    return absl::InvalidArgumentError(absl::StrCat(
        "PowerSGD state: 'iter' is ", *saved_iter, ", expected ", *expected_iter,
        " (the iteration the checkpoint was written at); the hook state belongs to another step or run: resume "
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
    return malformed(absl::StrCat("'error_dict' has ", error->size(), " entries, expected none: use_error_feedback is false"));
  }
  if (!warm_start && (!p_memory->empty() || !q_memory->empty())) {
    return malformed(absl::StrCat("'p_memory_dict' and 'q_memory_dict' have ", p_memory->size(), " and ", q_memory->size(),
                                  " entries, expected none: warm_start is false"));
  }
  const bool paired = p_memory->size() == q_memory->size() &&
                      std::all_of(p_memory->begin(), p_memory->end(), [&](const auto& p) {
                        auto q = q_memory->find(p.first);
                        return q != q_memory->end() && q->second.scalar_type() == p.second.scalar_type();
                      });
  if (!paired) {
    return malformed("'p_memory_dict' and 'q_memory_dict' differ in their buckets or dtypes, expected both memories "
                     "of every bucket, in one dtype");
  }
  if (*saved_iter < start_powerSGD_iter && (!error->empty() || !p_memory->empty() || *before != 0)) {
    return malformed(absl::StrCat("'iter' is ", *saved_iter, ", before start_powerSGD_iter ", start_powerSGD_iter,
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
  rng = *saved_rng;
  rng_seeded = seeded->toBool();
  return absl::OkStatus();
}

void PowerSGDState::load_state_dict(const c10::IValue& state_dict) {
  const absl::Status s = load_state_dict(state_dict, std::nullopt);
  TORCH_CHECK(s.ok(), std::string(s.message()));
}

PowerSGDHook::PowerSGDHook(std::shared_ptr<PowerSGDState> state) : StatefulHook(std::move(state), "PowerSGDHook") {
  this->state().validate();
}

c10::intrusive_ptr<c10::ivalue::Future> PowerSGDHook::runHook(c10d::GradBucket& bucket) {
  PowerSGDState& s = state();
  const comm::Group& group = s.group;
  const int world = group.size();
  at::Tensor input = bucket.getBufferRef();
  auto maybe_increase_iter = [&] {
    // The last bucket closes an iteration.
    if (bucket.isLast()) ++s.iter;
  };
  if (s.iter < s.start_powerSGD_iter) {
    input.div_(world);
    allreduce(group, input);
    maybe_increase_iter();
    return done(input);
  }
  c10::NoGradGuard no_grad;
  const int64_t index = static_cast<int64_t>(bucket.getIndex());
  // I. Split into compressed and uncompressed tensors (views of the bucket).
  std::vector<at::Tensor> to_compress, uncompressed;
  int64_t ps_size = 0, qs_size = 0, numel_before = 0, numel_after = 0;
  for (const at::Tensor& grad : bucket.getGradients()) {
    const int64_t n = grad.dim() == 0 ? 1 : grad.size(0);
    const int64_t m = grad.numel() / std::max<int64_t>(n, 1);
    const int64_t r = std::min({n, m, s.matrix_approximation_rank});
    const int64_t before = n * m, after = (n + m) * r;
    numel_before += before;
    if (grad.dim() >= 2 && static_cast<double>(after) * s.min_compression_rate < static_cast<double>(before)) {
      to_compress.push_back(grad.view({n, m}));
      ps_size += n * r;
      qs_size += m * r;
      numel_after += after;
    } else {
      uncompressed.push_back(grad);
      numel_after += before;
    }
  }
  adopt_loaded(s, index, input, ps_size, qs_size);  // before anything changes
  s.total_numel_before_compression += numel_before;
  s.total_numel_after_compression += numel_after;
  at::Tensor input_copy;
  if (s.use_error_feedback) {
    auto it = s.error_dict.find(index);
    if (it != s.error_dict.end()) {
      input.add_(it->second);
    } else {
      s.error_dict[index] = at::zeros_like(input);
    }
    input_copy = input.clone();
  }
  // II. Uncompressed tensors: one all-reduce of their concatenation.
  std::vector<at::Tensor> flat_parts;
  for (const auto& t : uncompressed) flat_parts.push_back(t.reshape(-1));
  at::Tensor uncompressed_memory = flat_parts.empty() ? at::empty({0}, input.options()) : at::cat(flat_parts);
  // III. P and Q memories (reused across iterations with warm start).
  bool randomize_qs = false;
  if (!s.warm_start || s.p_memory_dict.count(index) == 0 || s.p_memory_dict[index].numel() != ps_size) {
    randomize_qs = true;
    s.p_memory_dict[index] = at::empty({ps_size}, input.options());
    s.q_memory_dict[index] = at::empty({qs_size}, input.options());
  }
  // Batches of matrices: same-shape ones stacked when asked.
  std::vector<std::vector<at::Tensor>> batches;
  if (s.batch_tensors_with_same_shape) {
    std::map<std::pair<int64_t, int64_t>, size_t> by_shape;
    for (const auto& t : to_compress) {
      auto key = std::make_pair(t.size(0), t.size(1));
      auto it = by_shape.find(key);
      if (it == by_shape.end()) {
        it = by_shape.emplace(key, batches.size()).first;
        batches.emplace_back();
      }
      batches[it->second].push_back(t);
    }
  } else {
    for (const auto& t : to_compress) batches.push_back({t});
  }
  std::vector<at::Tensor> mats, ps, qs;
  int64_t p_idx = 0, q_idx = 0;
  for (const auto& batch : batches) {
    at::Tensor m = batch.size() == 1 ? batch[0].unsqueeze(0) : at::stack(batch);
    const int64_t b = m.size(0), n = m.size(1), cols = m.size(2);
    const int64_t r = std::min({n, cols, s.matrix_approximation_rank});
    mats.push_back(m);
    ps.push_back(s.p_memory_dict[index].narrow(0, p_idx, b * n * r).view({b, n, r}));
    qs.push_back(s.q_memory_dict[index].narrow(0, q_idx, b * cols * r).view({b, cols, r}));
    p_idx += b * n * r;
    q_idx += b * cols * r;
  }
  if (!randomize_qs) {
    for (auto& q : qs) orthogonalize(q, s.orthogonalization_epsilon);
  } else {
    // The same random Qs on every rank: a seeded generator advanced identically everywhere. As
    // PyTorch does, drawn on the CPU in the bucket's dtype and copied to the bucket's device (a
    // CPU generator cannot fill a device tensor, and the numbers stay the same on any device).
    if (!s.rng_seeded) {
      s.rng.seed(s.random_seed);
      s.rng_seeded = true;
    }
    auto gen = at::make_generator<at::CPUGeneratorImpl>(s.rng() % 1000000000ULL);
    for (auto& q : qs) {
      q.copy_(at::randn(q.sizes(), gen, q.options().device(at::kCPU)));
      orthogonalize(q, s.orthogonalization_epsilon);
    }
  }
  // P = M Q, all-reduced (no division: P is orthogonalised next).
  for (size_t k = 0; k < mats.size(); ++k) bmm_into(ps[k], mats[k], qs[k]);
  allreduce(group, uncompressed_memory);
  uncompressed_memory.div_(world);
  int64_t offset = 0;
  for (auto& t : uncompressed) {
    t.copy_(uncompressed_memory.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
  allreduce(group, s.p_memory_dict[index]);
  for (auto& p : ps) orthogonalize(p, s.orthogonalization_epsilon);
  // Q = M^T P, all-reduced and averaged.
  for (size_t k = 0; k < mats.size(); ++k) bmm_into(qs[k], mats[k].transpose(1, 2), ps[k]);
  allreduce(group, s.q_memory_dict[index]);
  s.q_memory_dict[index].div_(world);
  // Decompress: M ~ P Q^T, into the bucket.
  for (size_t k = 0; k < mats.size(); ++k) {
    at::Tensor approx = reduced_on_cpu(ps[k]) ? at::bmm(ps[k].to(at::kFloat), qs[k].transpose(1, 2).to(at::kFloat))
                                              : at::bmm(ps[k], qs[k].transpose(1, 2));
    if (batches[k].size() == 1) {
      batches[k][0].copy_(approx[0]);
    } else {
      for (size_t j = 0; j < batches[k].size(); ++j) batches[k][j].copy_(approx[static_cast<int64_t>(j)]);
    }
  }
  if (s.use_error_feedback) s.error_dict[index] = input_copy - input;
  if (!s.warm_start) {
    s.p_memory_dict.clear();
    s.q_memory_dict.clear();
  }
  maybe_increase_iter();
  return done(input);
}

}  // namespace dtrain::ddp_hooks
