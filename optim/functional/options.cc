#include "optim/functional/options.h"

#include <cmath>
#include <sstream>

namespace dtrain::optim {

std::string python_float_repr(double v) {
  std::ostringstream os;
  os.precision(17);
  for (int p = 1; p <= 17; ++p) {
    std::ostringstream t;
    t.precision(p);
    t << v;
    if (std::stod(t.str()) == v || std::isnan(v)) {
      std::string s = t.str();
      if (s.find_first_of(".einn") == std::string::npos) s += ".0";
      return s;
    }
  }
  os << v;
  return os.str();
}

double option_value(const OptionsDict& d, const std::string& key, double*) {
  const c10::IValue& v = d.at(key);
  TORCH_CHECK(v.isDouble() || v.isInt(), "option '", key, "' must be a number, got ", v.tagKind());
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}

bool option_value(const OptionsDict& d, const std::string& key, bool*) {
  const c10::IValue& v = d.at(key);
  TORCH_CHECK(v.isBool(), "option '", key, "' must be a bool, got ", v.tagKind());
  return v.toBool();
}

namespace {

// The items of a tuple or list value (empty for anything else).
std::vector<c10::IValue> sequence_items(const c10::IValue& v) {
  std::vector<c10::IValue> items;
  if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) items.push_back(e);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) items.push_back(e);
  } else if (v.isDoubleList()) {
    for (double e : v.toDoubleVector()) items.emplace_back(e);
  }
  return items;
}
bool is_number(const c10::IValue& e) { return e.isDouble() || e.isInt(); }
double number(const c10::IValue& e) {
  return e.isDouble() ? e.toDouble() : static_cast<double>(e.toInt());
}

}  // namespace

DoublePair option_value(const OptionsDict& d, const std::string& key, DoublePair*) {
  const std::vector<c10::IValue> items = sequence_items(d.at(key));
  TORCH_CHECK(items.size() == 2 && is_number(items[0]) && is_number(items[1]), "option '", key,
              "' must be a pair of numbers");
  return {number(items[0]), number(items[1])};
}

int64_t option_value(const OptionsDict& d, const std::string& key, int64_t*) {
  const c10::IValue& v = d.at(key);
  if (v.isInt()) return v.toInt();
  TORCH_CHECK(
      v.isDouble() && std::nearbyint(v.toDouble()) == v.toDouble() && std::abs(v.toDouble()) < 9e15,
      "option '", key, "' must be an int, got ",
      v.isDouble() ? python_float_repr(v.toDouble()) : v.tagKind());
  return static_cast<int64_t>(v.toDouble());
}

OptionalDoublePair option_value(const OptionsDict& d, const std::string& key, OptionalDoublePair*) {
  const std::vector<c10::IValue> items = sequence_items(d.at(key));
  TORCH_CHECK(
      items.size() == 2 && (items[0].isNone() || is_number(items[0])) && is_number(items[1]),
      "option '", key, "' must be a pair (number or None, number)");
  return {items[0].isNone() ? std::nullopt : std::optional<double>(number(items[0])),
          number(items[1])};
}

DoubleTriple option_value(const OptionsDict& d, const std::string& key, DoubleTriple*) {
  const std::vector<c10::IValue> items = sequence_items(d.at(key));
  TORCH_CHECK(
      items.size() == 3 && is_number(items[0]) && is_number(items[1]) && is_number(items[2]),
      "option '", key, "' must be a tuple of exactly 3 numbers");
  return {number(items[0]), number(items[1]), number(items[2])};
}

OptionalString option_value(const OptionsDict& d, const std::string& key, OptionalString*) {
  const c10::IValue& v = d.at(key);
  TORCH_CHECK(v.isNone() || v.isString(), "option '", key, "' must be a string or None, got ",
              v.tagKind());
  return v.isNone() ? std::nullopt : OptionalString(v.toStringRef());
}

OptionalBool option_value(const OptionsDict& d, const std::string& key, OptionalBool*) {
  const c10::IValue& v = d.at(key);
  TORCH_CHECK(v.isNone() || v.isBool(), "option '", key, "' must be True, False or None, got ",
              v.tagKind());
  return v.isNone() ? std::nullopt : OptionalBool(v.toBool());
}

c10::IValue option_ivalue(double v) { return v; }
c10::IValue option_ivalue(bool v) { return v; }
c10::IValue option_ivalue(const DoublePair& v) {
  return c10::ivalue::Tuple::create({std::get<0>(v), std::get<1>(v)});
}
c10::IValue option_ivalue(int64_t v) { return v; }
c10::IValue option_ivalue(const OptionalDoublePair& v) {
  const std::optional<double>& first = std::get<0>(v);
  return c10::ivalue::Tuple::create({first ? c10::IValue(*first) : c10::IValue(), std::get<1>(v)});
}
c10::IValue option_ivalue(const DoubleTriple& v) {
  return c10::ivalue::Tuple::create({std::get<0>(v), std::get<1>(v), std::get<2>(v)});
}
c10::IValue option_ivalue(const OptionalString& v) { return v ? c10::IValue(*v) : c10::IValue(); }
c10::IValue option_ivalue(const OptionalBool& v) { return v ? c10::IValue(*v) : c10::IValue(); }

OptionRule<double> non_negative(const char* what) {
  return [what](const double& v) { TORCH_CHECK(v >= 0.0, what, ": ", python_float_repr(v)); };
}

OptionRule<double> in_unit_interval(const char* what) {
  return [what](const double& v) {
    TORCH_CHECK(v >= 0.0 && v <= 1.0, what, ": ", python_float_repr(v));
  };
}

OptionRule<DoublePair> valid_betas() {
  return [](const DoublePair& b) {
    const double b0 = std::get<0>(b), b1 = std::get<1>(b);
    TORCH_CHECK(b0 >= 0.0 && b0 < 1.0,
                "Invalid beta parameter at index 0: ", python_float_repr(b0));
    TORCH_CHECK(b1 >= 0.0 && b1 < 1.0,
                "Invalid beta parameter at index 1: ", python_float_repr(b1));
  };
}

}  // namespace dtrain::optim
