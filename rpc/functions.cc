#include "rpc/functions.h"

#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dtrain::rpc {
namespace {

// Argument kinds on the wire (an integer before each argument).
enum Kind : int64_t {
  kTensor = 0,
  kDouble = 1,
  kInt = 2,
  kBool = 3,
  kString = 4,
  kIntList = 5,
  kDoubleList = 6
};
constexpr int64_t kMaxArgs = 1024;

std::string kinds(const std::vector<c10::IValue>& args) {
  std::vector<std::string> out;
  for (const auto& a : args) out.push_back(a.tagKind());
  return absl::StrCat("(", absl::StrJoin(out, ", "), ")");
}

bool is_number(const c10::IValue& v) { return v.isDouble() || v.isInt() || v.isBool(); }

// torch.add / torch.sub: (tensor, tensor or number[, alpha]).
RemoteFunction add_like(const char* name, double sign) {
  return [name, sign](const std::vector<c10::IValue>& a) {
    TORCH_CHECK((a.size() == 2 || (a.size() == 3 && is_number(a[2]))) && a[0].isTensor() &&
                    (a[1].isTensor() || is_number(a[1])),
                name, " takes (tensor, tensor or number[, alpha number]), got ", kinds(a));
    const double alpha = sign * (a.size() == 3 ? a[2].toScalar().toDouble() : 1.0);
    if (a[1].isTensor()) return at::add(a[0].toTensor(), a[1].toTensor(), alpha);
    return at::add(a[0].toTensor(), a[1].toScalar(), alpha);
  };
}

// Sizes as PyTorch's factories take them: ints, or one list of ints.
std::vector<int64_t> sizes(const char* name, const std::vector<c10::IValue>& a, size_t n) {
  if (n == 1 && a[0].isIntList()) return a[0].toIntVector();
  std::vector<int64_t> out;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(a[i].isInt(), name, " takes sizes as ints or one list of ints, got ", kinds(a));
    out.push_back(a[i].toInt());
  }
  return out;
}

void register_builtins(FunctionRegistry& r) {
  r.register_function("torch.add", add_like("torch.add", 1.0));
  r.register_function("torch.sub", add_like("torch.sub", -1.0));
  r.register_function("torch.mul", [](const std::vector<c10::IValue>& a) {
    TORCH_CHECK(a.size() == 2 && a[0].isTensor() && (a[1].isTensor() || is_number(a[1])),
                "torch.mul takes (tensor, tensor or number), got ", kinds(a));
    return a[1].isTensor() ? at::mul(a[0].toTensor(), a[1].toTensor())
                           : at::mul(a[0].toTensor(), a[1].toScalar());
  });
  r.register_function("torch.matmul", [](const std::vector<c10::IValue>& a) {
    TORCH_CHECK(a.size() == 2 && a[0].isTensor() && a[1].isTensor(),
                "torch.matmul takes (tensor, tensor), got ", kinds(a));
    return at::matmul(a[0].toTensor(), a[1].toTensor());
  });
  r.register_function("torch.ones", [](const std::vector<c10::IValue>& a) {
    return at::ones(sizes("torch.ones", a, a.size()), at::kFloat);
  });
  r.register_function("torch.zeros", [](const std::vector<c10::IValue>& a) {
    return at::zeros(sizes("torch.zeros", a, a.size()), at::kFloat);
  });
  r.register_function("torch.full", [](const std::vector<c10::IValue>& a) {
    TORCH_CHECK(a.size() == 2 && a[0].isIntList() && is_number(a[1]),
                "torch.full takes (list of sizes, number), got ", kinds(a));
    return at::full(a[0].toIntVector(), a[1].toScalar(), at::kFloat);
  });
}

}  // namespace

FunctionRegistry& FunctionRegistry::global() {
  static FunctionRegistry* registry = [] {
    auto* r = new FunctionRegistry();
    register_builtins(*r);
    return r;
  }();
  return *registry;
}

void FunctionRegistry::register_function(const std::string& name, RemoteFunction fn) {
  TORCH_CHECK(!name.empty() && fn, "register_function needs a name and a function");
  std::unique_lock<std::shared_mutex> lock(mu_);
  functions_[name] = std::make_shared<const RemoteFunction>(std::move(fn));
}

bool FunctionRegistry::contains(const std::string& name) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return functions_.count(name) > 0;
}

std::vector<std::string> FunctionRegistry::names() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& kv : functions_) out.push_back(kv.first);
  return out;
}

at::Tensor FunctionRegistry::call(const std::string& name,
                                  const std::vector<c10::IValue>& args) const {
  std::shared_ptr<const RemoteFunction> fn;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    auto it = functions_.find(name);
    if (it != functions_.end()) fn = it->second;
  }
  TORCH_CHECK(fn != nullptr, "no function named '", name,
              "' is registered on this worker (registered: ", absl::StrJoin(names(), ", "),
              "); register it with FunctionRegistry::register_function on every worker");
  at::Tensor out = (*fn)(args);
  TORCH_CHECK(out.defined(), "function '", name,
              "' returned an undefined tensor; it must return the value to keep");
  return out;
}

void write_args(Writer& w, std::vector<at::Tensor>& tensors, const std::vector<c10::IValue>& args) {
  TORCH_CHECK(static_cast<int64_t>(args.size()) <= kMaxArgs, "at most ", kMaxArgs,
              " arguments, got ", args.size());
  w.i64(static_cast<int64_t>(args.size()));
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = args[i];
    if (v.isTensor()) {
      TORCH_CHECK(v.toTensor().defined(), "argument ", i, " is an undefined tensor");
      w.i64(kTensor);
      tensors.push_back(v.toTensor().detach());
    } else if (v.isDouble()) {
      w.i64(kDouble).f64(v.toDouble());
    } else if (v.isBool()) {
      w.i64(kBool).boolean(v.toBool());
    } else if (v.isInt()) {
      w.i64(kInt).i64(v.toInt());
    } else if (v.isString()) {
      w.i64(kString).str(v.toStringRef());
    } else if (v.isIntList()) {
      w.i64(kIntList).i64_list(v.toIntVector());
    } else if (v.isDoubleList()) {
      w.i64(kDoubleList).f64_list(v.toDoubleVector());
    } else {
      TORCH_CHECK(
          false, "argument ", i, " has a type (", v.tagKind(),
          ") that cannot travel: use tensors, numbers, booleans, strings or lists of numbers");
    }
  }
}

std::vector<c10::IValue> read_args(Reader& r, const std::vector<at::Tensor>& tensors) {
  const int64_t n = r.i64();
  if (n < 0 || n > kMaxArgs)
    throw CodecError(absl::StrCat("argument count ", n, " out of range 0..", kMaxArgs));
  std::vector<c10::IValue> args;
  size_t next_tensor = 0;
  for (int64_t i = 0; i < n; ++i) {
    switch (r.i64()) {
      case kTensor:
        if (next_tensor >= tensors.size()) {
          throw CodecError(
              absl::StrCat("argument ", i, " is a tensor but only ", tensors.size(), " travelled"));
        }
        args.emplace_back(tensors[next_tensor++]);
        break;
      case kDouble:
        args.emplace_back(r.f64());
        break;
      case kInt:
        args.emplace_back(r.i64());
        break;
      case kBool:
        args.emplace_back(r.boolean());
        break;
      case kString:
        args.emplace_back(r.str());
        break;
      case kIntList:
        args.emplace_back(r.i64_list());
        break;
      case kDoubleList:
        args.emplace_back(r.f64_list());
        break;
      default:
        throw CodecError(absl::StrCat("argument ", i, " has an unknown kind"));
    }
  }
  if (next_tensor != tensors.size()) {
    throw CodecError(
        absl::StrCat(tensors.size(), " tensors travelled but the arguments use ", next_tensor));
  }
  return args;
}

}  // namespace dtrain::rpc
