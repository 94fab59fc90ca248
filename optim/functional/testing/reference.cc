#include "optim/functional/testing/reference.h"

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace dtrain::optim::testing {
namespace {

c10::IValue parse_value(const std::string& text) {
  if (text == "True") return true;
  if (text == "False") return false;
  if (text == "none") return c10::IValue();
  if (text.find(',') != std::string::npos) {
    std::vector<std::string> parts = absl::StrSplit(text, ',');
    std::vector<c10::IValue> items;
    for (const auto& p : parts)
      items.push_back(p == "none" ? c10::IValue() : c10::IValue(std::stod(p)));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  int64_t i = 0;
  if (absl::SimpleAtoi(text, &i))
    return i;  // an int option (Muon's ns_steps); floats carry '.' or 'e'
  double v = 0;
  if (absl::SimpleAtod(text, &v)) return v;
  return text;  // a string option (QHM's weight_decay_type)
}

}  // namespace

std::vector<ReferenceCase> read_reference(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "cannot open reference file ", path);
  std::string line;
  std::getline(in, line);
  TORCH_CHECK(line == "dtrain-optim-reference 1", path, ": not a reference file (", line, ")");
  std::vector<ReferenceCase> cases;
  std::vector<std::vector<int64_t>> state_sizes;
  while (std::getline(in, line) && line != "data") {
    std::istringstream ls(line);
    std::string tag;
    ls >> tag;
    if (tag == "optimizer" || tag == "end") continue;
    if (tag == "case") {
      cases.emplace_back();
      ls >> cases.back().name;
      state_sizes.emplace_back();
      continue;
    }
    TORCH_CHECK(!cases.empty(), path, ": '", tag, "' before any case");
    ReferenceCase& c = cases.back();
    std::string item;
    if (tag == "options") {
      while (ls >> item) {
        const size_t eq = item.find('=');
        c.options.insert(item.substr(0, eq), parse_value(item.substr(eq + 1)));
      }
    } else if (tag == "shapes") {
      while (ls >> item) {
        std::vector<int64_t> shape;
        for (absl::string_view d : absl::StrSplit(item, ','))
          shape.push_back(std::stoll(std::string(d)));
        c.shapes.push_back(shape);
      }
    } else if (tag == "sparse_grads") {
      ls >> c.sparse_dim;
    } else if (tag == "steps") {
      ls >> c.steps;
      c.missing.assign(c.steps, std::vector<bool>(c.shapes.size(), false));
    } else if (tag == "missing") {
      while (ls >> item) {
        const size_t colon = item.find(':');
        c.missing[std::stoi(item.substr(colon + 1))][std::stoi(item.substr(0, colon))] = true;
      }
    } else if (tag == "state") {
      StateValue v;
      std::string numel;
      ls >> v.param >> v.key >> numel >> v.kind;
      c.final_state.push_back(v);
      state_sizes.back().push_back(numel == "none" ? -1 : std::stoll(numel));
    } else {
      TORCH_CHECK(false, path, ": unknown header line '", line, "'");
    }
  }
  auto read = [&](const std::vector<int64_t>& shape) {
    at::Tensor t = at::empty(shape, at::kDouble);
    in.read(static_cast<char*>(t.data_ptr()), t.numel() * 8);
    TORCH_CHECK(in, path, ": truncated data");
    return t;
  };
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    ReferenceCase& c = cases[ci];
    for (const auto& s : c.shapes) c.init.push_back(read(s));
    for (int step = 0; step < c.steps; ++step) {
      c.grads.emplace_back();
      c.params64.emplace_back();
      c.params32.emplace_back();
      for (const auto& s : c.shapes) c.grads.back().push_back(read(s));
      for (const auto& s : c.shapes) c.params64.back().push_back(read(s));
      for (const auto& s : c.shapes) c.params32.back().push_back(read(s));
    }
    for (size_t k = 0; k < c.final_state.size(); ++k) {
      const int64_t n = state_sizes[ci][k];
      if (n >= 0) c.final_state[k].value = read({n});
    }
  }
  return cases;
}

at::Tensor ReferenceCase::grad(int step, size_t param, at::ScalarType dtype) const {
  if (missing[step][param]) return at::Tensor();
  at::Tensor g = grads[step][param].to(dtype);
  return sparse_dim > 0 ? g.to_sparse(sparse_dim) : g;
}

at::Tensor make_param(const at::Tensor& init, at::ScalarType dtype, Layout layout) {
  if (layout == Layout::kContiguous) return init.to(dtype).clone();
  std::vector<int64_t> shape = init.sizes().vec();
  shape.push_back(2);
  at::Tensor p = at::zeros(shape, dtype).select(-1, 0);
  p.copy_(init);
  return p;
}

double relative_error(const at::Tensor& a, const at::Tensor& b) {
  const double scale = b.abs().max().item<double>();
  const double diff = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  if (scale == 0) return diff;
  return diff / scale;
}

OptionsDict options_dict(const std::vector<std::pair<const char*, c10::IValue>>& kv) {
  OptionsDict d = new_options_dict();
  for (const auto& [k, v] : kv) d.insert(k, v);
  return d;
}

}  // namespace dtrain::optim::testing
