#include "optim/functional_optimizer_options.h"

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

DoublePair option_value(const OptionsDict& d, const std::string& key, DoublePair*) {
  const c10::IValue& v = d.at(key);
  std::vector<c10::IValue> items;
  if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) items.push_back(e);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) items.push_back(e);
  } else if (v.isDoubleList()) {
    for (double e : v.toDoubleVector()) items.emplace_back(e);
  }
  TORCH_CHECK(items.size() == 2 && (items[0].isDouble() || items[0].isInt()) &&
                  (items[1].isDouble() || items[1].isInt()),
              "option '", key, "' must be a pair of numbers");
  auto num = [](const c10::IValue& e) { return e.isDouble() ? e.toDouble() : static_cast<double>(e.toInt()); };
  return {num(items[0]), num(items[1])};
}

c10::IValue option_ivalue(double v) { return v; }
c10::IValue option_ivalue(bool v) { return v; }
c10::IValue option_ivalue(const DoublePair& v) { return c10::ivalue::Tuple::create({std::get<0>(v), std::get<1>(v)}); }

OptionRule<double> non_negative(const char* what) {
  return [what](const double& v) { TORCH_CHECK(v >= 0.0, what, ": ", python_float_repr(v)); };
}

OptionRule<double> in_unit_interval(const char* what) {
  return [what](const double& v) { TORCH_CHECK(v >= 0.0 && v <= 1.0, what, ": ", python_float_repr(v)); };
}

OptionRule<DoublePair> valid_betas() {
  return [](const DoublePair& b) {
    const double b0 = std::get<0>(b), b1 = std::get<1>(b);
    TORCH_CHECK(b0 >= 0.0 && b0 < 1.0, "Invalid beta parameter at index 0: ", python_float_repr(b0));
    TORCH_CHECK(b1 >= 0.0 && b1 < 1.0, "Invalid beta parameter at index 1: ", python_float_repr(b1));
  };
}

}  // namespace dtrain::optim
