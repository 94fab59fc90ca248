#include "optim/functional/state_checks.h"

#include <charconv>
#include <cmath>
#include <map>
#include <set>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "optim/functional/state_precision.h"

namespace dtrain::optim {
namespace {

absl::Status invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

// The shortest text that reads back as `v` ("nan", "inf", "-50", "2.5", "1e+300").
std::string number_text(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buffer[64];
  const std::to_chars_result r = std::to_chars(buffer, buffer + sizeof(buffer), v);
  return std::string(buffer, r.ptr);
}

// 2^63: the first double a step count (int64) cannot hold.
constexpr double kTwoPow63 = 9223372036854775808.0;

absl::StatusOr<int64_t> step_from_double(double v) {
  if (std::isnan(v)) return invalid("is nan, not a step count");
  if (std::isinf(v))
    return invalid(absl::StrCat("is ", v > 0 ? "inf" : "-inf", ", not a step count"));
  if (v < 0) return invalid(absl::StrCat("is ", number_text(v), ", below 0"));
  if (v >= kTwoPow63) {
    return invalid(absl::StrCat("is ", number_text(v), ", beyond what a step count (int64) holds"));
  }
  if (std::nearbyint(v) != v) {
    return invalid(absl::StrCat("is ", number_text(v), ", not a whole number of steps"));
  }
  return static_cast<int64_t>(v);
}

bool is_real_number_dtype(at::ScalarType t) {
  return at::isFloatingType(t) || (at::isIntegralType(t, /*includeBool=*/false));
}

// The first element of `t` (flattened) that is not finite, or -1.
int64_t first_non_finite(const at::Tensor& t) {
  const at::Tensor bad = at::logical_not(at::isfinite(t)).reshape(-1);
  if (!bad.any().item<bool>()) return -1;
  return bad.to(at::kByte).argmax().item<int64_t>();
}

}  // namespace

absl::StatusOr<int64_t> loaded_step(const c10::IValue& step) {
  if (step.isInt()) {
    if (step.toInt() < 0) return invalid(absl::StrCat("is ", step.toInt(), ", below 0"));
    return step.toInt();
  }
  if (step.isDouble()) return step_from_double(step.toDouble());
  if (!step.isTensor()) {
    return invalid(absl::StrCat("is a ", step.tagKind(),
                                ", not a number (a step count is an int, a float or a one-element "
                                "tensor)"));
  }
  const at::Tensor& t = step.toTensor();
  if (t.layout() != at::kStrided) return invalid("is a sparse tensor, not one number");
  if (t.numel() != 1) {
    return invalid(absl::StrCat("is a tensor of ", t.numel(), " elements (shape ",
                                absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]"),
                                "), not one number"));
  }
  if (!is_real_number_dtype(t.scalar_type())) {
    return invalid(
        absl::StrCat("is a ", c10::toString(t.scalar_type()), " tensor, not a real number"));
  }
  if (at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
    const int64_t v = t.item<int64_t>();
    if (v < 0) return invalid(absl::StrCat("is ", v, ", below 0"));
    return v;
  }
  return step_from_double(t.item<double>());
}

absl::Status check_8bit_slot(const at::Tensor& codes, const at::Tensor& absmax,
                             c10::IntArrayRef shape) {
  if (codes.layout() != at::kStrided || codes.scalar_type() != at::kByte) {
    return invalid(absl::StrCat("has _codes of type ", c10::toString(codes.scalar_type()),
                                "; an 8-bit slot's codes are a dense uint8 tensor"));
  }
  if (!codes.sizes().equals(shape)) {
    return invalid(absl::StrCat("has _codes of shape [", absl::StrJoin(codes.sizes(), ", "),
                                "], the slot has shape [", absl::StrJoin(shape, ", "), "]"));
  }
  const int64_t blocks = quant_blocks(c10::multiply_integers(shape));
  if (absmax.layout() != at::kStrided || !at::isFloatingType(absmax.scalar_type()) ||
      absmax.dim() != 1 || absmax.numel() != blocks) {
    return invalid(absl::StrCat(
        "has _absmax of shape [", absl::StrJoin(absmax.sizes(), ", "), "] and type ",
        c10::toString(absmax.scalar_type()), "; an 8-bit slot of ", c10::multiply_integers(shape),
        " elements has ", blocks, " float scales (one per block of ", kQuantBlock, ")"));
  }
  const at::Tensor scales = absmax.to(at::kFloat);
  const int64_t bad = first_non_finite(scales);
  if (bad >= 0) return invalid(absl::StrCat("has a non-finite _absmax at block ", bad));
  if (scales.numel() > 0 && scales.min().item<float>() < 0) {
    return invalid("has a negative _absmax; scales are absolute maxima");
  }
  return absl::OkStatus();
}

absl::Status check_state_tensor(const at::Tensor& t, const at::Tensor& param,
                                c10::IntArrayRef shape, const std::string& optimizer) {
  if (t.layout() != at::kStrided) {
    return invalid(
        absl::StrCat("is a ", c10::toString(t.layout()), " tensor; optimizer state is dense"));
  }
  if (!at::isFloatingType(t.scalar_type())) {
    return invalid(absl::StrCat("is a ", c10::toString(t.scalar_type()),
                                " tensor; optimizer state is floating point (it is cast to the "
                                "parameter's ",
                                c10::toString(param.scalar_type()), ", as PyTorch does)"));
  }
  if (!t.sizes().equals(shape)) {
    const std::string has = absl::StrCat("has shape [", absl::StrJoin(t.sizes(), ", "), "], ");
    const std::string param_shape = absl::StrCat("[", absl::StrJoin(param.sizes(), ", "), "]");
    if (param.sizes().equals(shape)) return invalid(has + "the parameter has shape " + param_shape);
    return invalid(absl::StrCat(has, optimizer, " keeps it with shape [",
                                absl::StrJoin(shape, ", "), "] for a parameter of shape ",
                                param_shape));
  }
  // Finite in the dtype it will have: PyTorch casts state to a floating parameter's dtype.
  const at::Tensor cast = at::isFloatingType(param.scalar_type()) ? t.to(param.scalar_type()) : t;
  const int64_t bad = first_non_finite(cast);
  if (bad >= 0) {
    const double v = cast.reshape(-1)[bad].item<double>();
    return invalid(
        absl::StrCat("holds ", std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf"), " (element ", bad,
                     cast.scalar_type() != t.scalar_type()
                         ? absl::StrCat(", once cast to ", c10::toString(cast.scalar_type()))
                         : "",
                     "); optimizer state must be finite"));
  }
  return absl::OkStatus();
}

absl::Status load_param_remainder(const c10::IValue* value, const at::Tensor& param,
                                  const std::string& optimizer, int64_t file_index, bool copy,
                                  at::Tensor* slot) {
  auto fail = [&](const std::string& problem) {
    return state_error(optimizer + ".load_state_dict", kParamRemainderKey, file_index,
                       invalid(problem));
  };
  if (value == nullptr) return fail("is there as 8-bit codes; a remainder is one int16 tensor");
  if (value->isNone()) return absl::OkStatus();  // none yet: the next step starts from 0
  if (!value->isTensor()) return fail(absl::StrCat("is a ", value->tagKind(), ", not a tensor"));
  const at::Tensor& t = value->toTensor();
  if (param.scalar_type() != at::kBFloat16) {
    return fail(absl::StrCat("is there, but the parameter is ", c10::toString(param.scalar_type()),
                             "; only a bfloat16 parameter keeps a 16-bit remainder"));
  }
  if (t.layout() != at::kStrided || t.scalar_type() != at::kShort) {
    return fail(absl::StrCat(
        "is a ", c10::toString(t.scalar_type()),
        " tensor; a remainder is a dense int16 tensor (PyTorch's load_state_dict casts it to the "
        "parameter's bfloat16, which loses it: save it from dtrain, not through PyTorch)"));
  }
  if (!t.sizes().equals(param.sizes())) {
    return fail(absl::StrCat("has shape [", absl::StrJoin(t.sizes(), ", "),
                             "], the parameter has shape [", absl::StrJoin(param.sizes(), ", "),
                             "]"));
  }
  if (copy) *slot = t.to(param.device()).contiguous().clone();
  return absl::OkStatus();
}

absl::Status state_error(const std::string& what, const std::string& key, int64_t file_index,
                         const absl::Status& problem) {
  return invalid(absl::StrCat(what, ": state '", key, "' of parameter ", file_index, " ",
                              problem.message(), "; ", kLoadAdvice));
}

absl::Status check_param_indices(const checkpoint::OptimizerStateDict& state_dict, size_t count,
                                 const std::string& what, size_t group_base) {
  std::map<int64_t, size_t> group_of;
  const auto n = static_cast<int64_t>(count);
  for (size_t g = 0; g < state_dict.param_groups.size(); ++g) {
    const size_t file_group = group_base + g;
    for (int64_t i : state_dict.param_groups[g].params) {
      if (i < 0 || i >= n) {
        return invalid(absl::StrCat(what, ": param_groups[", file_group, "]['params'] holds ", i,
                                    ", not a parameter index in [0, ", n, "); ", kLoadAdvice));
      }
      auto [it, fresh] = group_of.emplace(i, file_group);
      if (!fresh) {
        return invalid(absl::StrCat(what, ": parameter ", i,
                                    " is listed twice in 'params' (param_groups[", it->second,
                                    "] and param_groups[", file_group, "]); ", kLoadAdvice));
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (group_of.count(i) == 0) {
      return invalid(absl::StrCat(what, ": parameter ", i,
                                  " is in no param group's 'params' (each of 0..", n - 1,
                                  " must be listed once); ", kLoadAdvice));
    }
  }
  for (const auto& [index, entry] : state_dict.state) {
    if (group_of.count(index) == 0) {
      return invalid(absl::StrCat(what, ": 'state' has an entry for parameter ", index,
                                  ", which no param group lists (parameters are 0..", n - 1, "); ",
                                  kLoadAdvice));
    }
  }
  return absl::OkStatus();
}

namespace {

// The first non-finite number in `v` (a float, or one in a tuple or list), as text; "" if none.
std::string non_finite_number(const c10::IValue& v) {
  if (v.isDouble()) return std::isfinite(v.toDouble()) ? "" : number_text(v.toDouble());
  std::vector<c10::IValue> items;
  if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) items.push_back(e);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) items.push_back(e);
  } else if (v.isDoubleList()) {
    for (double e : v.toDoubleVector()) items.emplace_back(e);
  }
  for (const c10::IValue& e : items) {
    if (e.isDouble() && !std::isfinite(e.toDouble())) return number_text(e.toDouble());
  }
  return "";
}

}  // namespace

absl::Status check_option_numbers(const checkpoint::ParamGroup& group, size_t group_index,
                                  const std::string& what) {
  for (const auto& kv : group.options) {
    const std::string bad = non_finite_number(kv.value());
    if (!bad.empty()) {
      return invalid(absl::StrCat(what, ": param_groups[", group_index, "]['",
                                  kv.key().toStringRef(), "'] holds ", bad,
                                  "; an optimizer's options must be finite; ", kLoadAdvice));
    }
  }
  return absl::OkStatus();
}

absl::Status check_generic_entry(const checkpoint::StateEntry& entry, const at::Tensor& param,
                                 int64_t file_index, const std::string& what) {
  for (const auto& kv : entry) {
    const std::string& key = kv.key().toStringRef();
    const c10::IValue& v = kv.value();
    if (key == "step") {
      absl::StatusOr<int64_t> step = loaded_step(v);
      if (!step.ok()) return state_error(what, key, file_index, step.status());
      continue;
    }
    if (v.isNone()) continue;
    if (!v.isTensor()) {
      return state_error(what, key, file_index,
                         invalid(absl::StrCat("is a ", v.tagKind(), ", not a tensor")));
    }
    absl::Status s = check_state_tensor(v.toTensor(), param, param.sizes());
    if (!s.ok()) return state_error(what, key, file_index, s);
  }
  return absl::OkStatus();
}

}  // namespace dtrain::optim
