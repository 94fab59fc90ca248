// The allow-listed globals of the pickle reader and the calls to them. Nothing here looks a name
// up dynamically: each allowed (module, name) maps to code written below or, for tensor rebuilds
// and persistent ids (storages), in pickle_tensors.cc.
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cctype>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "checkpoint/pickle_internal.h"

namespace dtrain::checkpoint::pickle_internal {
namespace {

struct Known {
  const char* module;
  const char* name;
  int32_t global;
};

constexpr Known kAllowed[] = {
    {"collections", "OrderedDict", kOrderedDict},
    {"torch._utils", "_rebuild_tensor_v2", kRebuildTensorV2},
    {"torch._utils", "_rebuild_tensor", kRebuildTensor},
    {"torch._utils", "_rebuild_parameter", kRebuildParameter},
    {"torch._utils", "_rebuild_parameter_with_state", kRebuildParameterWithState},
    {"torch.jit._pickle", "restore_type_tag", kRestoreTypeTag},
    {"torch.jit._pickle", "build_intlist", kBuildIntList},
    {"torch.jit._pickle", "build_doublelist", kBuildDoubleList},
    {"torch.jit._pickle", "build_boollist", kBuildBoolList},
    {"torch.jit._pickle", "build_tensorlist", kBuildTensorList},
    {"torch", "Size", kTorchSize},
    {"torch", "device", kTorchDevice},
    {"_codecs", "encode", kCodecsEncode},
};

struct StorageClass {
  const char* name;
  at::ScalarType dtype;
};

constexpr StorageClass kStorageClasses[] = {
    {"FloatStorage", at::kFloat},
    {"DoubleStorage", at::kDouble},
    {"HalfStorage", at::kHalf},
    {"BFloat16Storage", at::kBFloat16},
    {"LongStorage", at::kLong},
    {"IntStorage", at::kInt},
    {"ShortStorage", at::kShort},
    {"CharStorage", at::kChar},
    {"ByteStorage", at::kByte},
    {"BoolStorage", at::kBool},
    {"ComplexFloatStorage", at::kComplexFloat},
    {"ComplexDoubleStorage", at::kComplexDouble},
};

std::string global_name(int32_t g) {
  if (is_dcp_global(g)) return dcp_global_name(g);
  for (const Known& k : kAllowed) {
    if (k.global == g) return absl::StrCat(k.module, ".", k.name);
  }
  for (const StorageClass& s : kStorageClasses) {
    if (kStorageClass + static_cast<int32_t>(s.dtype) == g) return absl::StrCat("torch.", s.name);
  }
  return "?";
}

}  // namespace

absl::Status arity(const Context& ctx, int32_t g, const std::vector<Item>& args, size_t lo,
                   size_t hi) {
  if (args.size() >= lo && args.size() <= hi) return absl::OkStatus();
  return ctx.data_loss(absl::StrCat(global_name(g), " is called with ", args.size(),
                                    " arguments, expected ", lo,
                                    lo == hi ? "" : absl::StrCat(" to ", hi)));
}

absl::StatusOr<std::vector<int64_t>> ints(const Context& ctx, const Item& item, const char* what) {
  std::vector<int64_t> out;
  std::vector<c10::IValue> values;
  if (item.is_value() && item.value.isTuple()) {
    for (const c10::IValue& v : item.value.toTupleRef().elements()) values.push_back(v);
  } else if (item.is_value() && item.value.isList()) {
    for (const c10::IValue& v : item.value.toListRef()) values.push_back(v);
  } else {
    return ctx.data_loss(absl::StrCat(what, " is ", describe(item), ", not a tuple of ints"));
  }
  for (const c10::IValue& v : values) {
    if (!v.isInt()) return ctx.data_loss(absl::StrCat(what, " holds something other than ints"));
    out.push_back(v.toInt());
  }
  return out;
}

namespace {

// LibTorch's type annotations (annotation_str): Dict[K, V], List[T], Optional[T], Tuple[...],
// Tensor, int, float, str, bool, Any, NoneType; anything else reads as Any.
class TypeParser {
 public:
  explicit TypeParser(std::string_view s) : s_(s) {}
  // nullptr on a syntax error.
  c10::TypePtr parse_all() {
    c10::TypePtr t = parse(0);
    skip();
    return t != nullptr && i_ == s_.size() ? t : nullptr;
  }

 private:
  void skip() {
    while (i_ < s_.size() && s_[i_] == ' ') ++i_;
  }
  bool eat(char c) {
    skip();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  c10::TypePtr parse(int depth) {
    if (depth > 64) return nullptr;
    skip();
    if (eat('(') && eat(')'))
      return c10::TupleType::create(std::vector<c10::TypePtr>{});  // "Tuple[()]"
    const size_t start = i_;
    while (i_ < s_.size() &&
           (std::isalnum(static_cast<unsigned char>(s_[i_])) || s_[i_] == '_' || s_[i_] == '.'))
      ++i_;
    const std::string_view name = s_.substr(start, i_ - start);
    if (name.empty()) return nullptr;
    std::vector<c10::TypePtr> args;
    if (eat('[')) {
      do {
        c10::TypePtr t = parse(depth + 1);
        if (t == nullptr) return nullptr;
        args.push_back(std::move(t));
      } while (eat(','));
      if (!eat(']')) return nullptr;
    }
    if (name == "Dict" && args.size() == 2) {
      const c10::TypeKind k = args[0]->kind();
      const bool hashable = k == c10::TypeKind::StringType || k == c10::TypeKind::IntType ||
                            k == c10::TypeKind::FloatType || k == c10::TypeKind::BoolType ||
                            k == c10::TypeKind::TensorType;
      return c10::DictType::create(hashable ? args[0] : c10::AnyType::get(), args[1]);
    }
    if (name == "List" && args.size() == 1) return c10::ListType::create(args[0]);
    if (name == "Optional" && args.size() == 1) return c10::OptionalType::create(args[0]);
    if (name == "Tuple") return c10::TupleType::create(std::move(args));
    if (!args.empty()) return c10::AnyType::get();
    if (name == "Tensor") return c10::TensorType::get();
    if (name == "int") return c10::IntType::get();
    if (name == "float") return c10::FloatType::get();
    if (name == "str") return c10::StringType::get();
    if (name == "bool") return c10::BoolType::get();
    if (name == "NoneType") return c10::NoneType::get();
    return c10::AnyType::get();
  }
  std::string_view s_;
  size_t i_ = 0;
};

bool is_a(const c10::IValue& v, const c10::TypePtr& t) {
  return t->kind() == c10::TypeKind::AnyType || v.type()->isSubtypeOf(*t);
}

// restore_type_tag(value, type): retypes a Dict(Any, Any) or List(Any) whose contents all match;
// anything else is returned as it is (a tag never makes a container claim what it does not hold).
absl::StatusOr<Item> restore_type_tag(const Context& ctx, const std::vector<Item>& a) {
  if (absl::Status s = arity(ctx, kRestoreTypeTag, a, 2, 2); !s.ok()) return s;
  if (!a[0].is_value() || !a[1].is_value() || !a[1].value.isString()) {
    return ctx.data_loss("restore_type_tag's arguments are not a value and a type name");
  }
  const c10::IValue& v = a[0].value;
  if (!v.isGenericDict() && !v.isList())
    return ctx.data_loss("restore_type_tag of something not a dict or list");
  c10::TypePtr t;
  try {
    t = TypeParser(a[1].value.toStringRef()).parse_all();
  } catch (const std::exception&) {  // a type LibTorch refuses to build (e.g. Optional[NoneType])
    t = nullptr;
  }
  if (t == nullptr) return a[0];
  if (v.isGenericDict() && t->kind() == c10::TypeKind::DictType) {
    c10::impl::GenericDict d = v.toGenericDict();
    const c10::TypePtr k = t->containedTypes()[0], val = t->containedTypes()[1];
    for (const auto& kv : d) {
      if (!is_a(kv.key(), k) || !is_a(kv.value(), val)) return a[0];
    }
    d.unsafeSetKeyType(k);
    d.unsafeSetValueType(val);
  } else if (v.isList() && t->kind() == c10::TypeKind::ListType) {
    c10::impl::GenericList l = v.toList();
    const c10::TypePtr e = t->containedTypes()[0];
    for (const c10::IValue& x : l) {
      if (!is_a(x, e)) return a[0];
    }
    l.unsafeSetElementType(e);
  }
  return a[0];
}

// build_intlist and friends: a typed list from a list of matching values.
template <typename T>
absl::StatusOr<Item> build_list(const Context& ctx, int32_t g, const std::vector<Item>& a,
                                bool (c10::IValue::*is)() const, T (*get)(const c10::IValue&)) {
  if (absl::Status s = arity(ctx, g, a, 1, 1); !s.ok()) return s;
  if (!a[0].is_value() || !a[0].value.isList())
    return ctx.data_loss(absl::StrCat(global_name(g), " of a non-list"));
  c10::List<T> out;
  for (const c10::IValue& v : a[0].value.toListRef()) {
    if (!(v.*is)())
      return ctx.data_loss(absl::StrCat(global_name(g), " of a list holding another type"));
    out.push_back(get(v));
  }
  return Item::of(c10::IValue(std::move(out)));
}

absl::StatusOr<Item> call_small(Context& ctx, int32_t g, const std::vector<Item>& a) {
  switch (g) {
    case kOrderedDict:
      if (!a.empty())
        return ctx.invalid("OrderedDict is called with items; dtrain reads OrderedDict() only");
      return Item::of(ctx.new_dict());
    case kTorchSize: {
      if (absl::Status s = arity(ctx, g, a, 0, 1); !s.ok()) return s;
      std::vector<c10::IValue> dims;
      if (!a.empty()) {
        absl::StatusOr<std::vector<int64_t>> n = ints(ctx, a[0], "torch.Size's argument");
        if (!n.ok()) return n.status();
        for (int64_t d : *n) dims.emplace_back(d);
      }
      return Item::of(c10::ivalue::Tuple::create(std::move(dims)), 1);
    }
    case kTorchDevice: {
      if (absl::Status s = arity(ctx, g, a, 1, 2); !s.ok()) return s;
      if (!a[0].is_value() || !a[0].value.isString() ||
          (a.size() == 2 && !(a[1].is_value() && a[1].value.isInt()))) {
        return ctx.data_loss("torch.device's arguments are not a type name and an index");
      }
      std::string spec = a[0].value.toStringRef();
      if (a.size() == 2) absl::StrAppend(&spec, ":", a[1].value.toInt());
      try {
        return Item::of(c10::IValue(c10::Device(spec)));
      } catch (const std::exception&) {
        return ctx.invalid(absl::StrCat("torch.device('", spec.substr(0, 64),
                                        "') is not a device LibTorch knows"));
      }
    }
    case kCodecsEncode: {  // protocol 2's bytes: _codecs.encode(str, 'latin1')
      if (absl::Status s = arity(ctx, g, a, 2, 2); !s.ok()) return s;
      if (!a[0].is_value() || !a[0].value.isString() || !a[1].is_value() ||
          !a[1].value.isString() ||
          (a[1].value.toStringRef() != "latin1" && a[1].value.toStringRef() != "latin-1")) {
        return ctx.invalid(
            "_codecs.encode is called other than as encode(str, 'latin1') for bytes");
      }
      const std::string& s = a[0].value.toStringRef();
      std::string out;
      for (size_t i = 0; i < s.size(); ++i) {
        const auto c = static_cast<unsigned char>(s[i]);
        if (c < 0x80) {
          out.push_back(static_cast<char>(c));
        } else if ((c == 0xc2 || c == 0xc3) && i + 1 < s.size()) {
          out.push_back(
              static_cast<char>(((c & 0x03) << 6) | (static_cast<unsigned char>(s[++i]) & 0x3f)));
        } else {
          return ctx.data_loss("_codecs.encode's str has a character outside latin-1");
        }
      }
      return Item::of(c10::IValue(std::move(out)));
    }
    case kBuildIntList:
      return build_list<int64_t>(ctx, g, a, &c10::IValue::isInt,
                                 [](const c10::IValue& v) { return v.toInt(); });
    case kBuildDoubleList:
      return build_list<double>(ctx, g, a, &c10::IValue::isDouble,
                                [](const c10::IValue& v) { return v.toDouble(); });
    case kBuildBoolList:
      return build_list<bool>(ctx, g, a, &c10::IValue::isBool,
                              [](const c10::IValue& v) { return v.toBool(); });
    case kBuildTensorList:
      return build_list<at::Tensor>(ctx, g, a, &c10::IValue::isTensor,
                                    [](const c10::IValue& v) { return v.toTensor(); });
    default:
      if (is_dcp_global(g)) return call_dcp(ctx, g, a);
      return ctx.invalid(absl::StrCat(describe(Item::global(g)), " cannot be called"));
  }
}

}  // namespace

absl::Status Context::data_loss(std::string_view what) const {
  return absl::DataLossError(
      absl::StrCat(name, " is damaged: its pickle, at byte ", offset, ": ", std::string(what)));
}

absl::Status Context::invalid(std::string_view what) const {
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": its pickle, at byte ", offset, ": ", std::string(what)));
}

c10::IValue Context::new_dict() {
  containers.emplace_back(c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get()));
  return containers.back();
}

c10::IValue Context::new_list() {
  containers.emplace_back(c10::impl::GenericList(c10::AnyType::get()));
  return containers.back();
}

std::vector<Item> tuple_elements(const Item& tuple) {
  if (tuple.raw != nullptr) return *tuple.raw;
  std::vector<Item> out;
  for (const c10::IValue& v : tuple.value.toTupleRef().elements())
    out.push_back(Item::of(v, v.isTuple() ? 1 : 0));
  return out;
}

std::string describe(const Item& item) {
  if (item.kind == Item::Kind::kGlobal)
    return absl::StrCat("the Python global ", global_name(item.ref));
  if (item.kind == Item::Kind::kStorage) return "a storage";
  if (item.raw != nullptr) return "a tuple holding a class or a storage";
  const c10::IValue& v = item.value;
  if (v.isNone()) return "None";
  if (v.isBool()) return "a bool";
  if (v.isInt()) return "an int";
  if (v.isDouble()) return "a float";
  if (v.isString()) return "a str";
  if (v.isTensor()) return "a tensor";
  if (v.isTuple()) return "a tuple";
  if (v.isList()) return "a list";
  if (v.isGenericDict()) return "a dict";
  return absl::StrCat("a ", v.tagKind());
}

absl::StatusOr<Item> resolve_global(const Context& ctx, std::string_view module,
                                    std::string_view name) {
  for (const Known& k : kAllowed) {
    if (module == k.module && name == k.name) return Item::global(k.global);
  }
  if (ctx.dialect == PickleDialect::kDcpMetadata) {
    if (std::optional<Item> g = resolve_dcp_global(module, name)) return *g;
  }
  if (module == "torch" && ctx.dialect == PickleDialect::kStateDict) {
    for (const StorageClass& s : kStorageClasses) {
      if (name == s.name) return Item::global(kStorageClass + static_cast<int32_t>(s.dtype));
    }
  }
  auto printable = [](std::string_view s) {
    std::string out;
    for (char c : s.substr(0, 100)) out.push_back(c >= 0x20 && c < 0x7f ? c : '?');
    return out;
  };
  if (ctx.dialect == PickleDialect::kDcpMetadata) {
    return ctx.invalid(absl::StrCat(
        "it refers to the Python global ", printable(module), ".", printable(name),
        ", which is not one of torch.distributed.checkpoint's metadata classes: dtrain reads "
        "only those and never runs code from a file. Save with torch.distributed.checkpoint's "
        "own FileSystemWriter (PyTorch 2.6-2.15)"));
  }
  return ctx.invalid(absl::StrCat("it refers to the Python global ", printable(module), ".",
                                  printable(name),
                                  ", which dtrain does not load: it reads only plain state dicts "
                                  "-- tensors, numbers, strings, None and "
                                  "dicts, lists and tuples of them, like torch.load(path, "
                                  "weights_only=True) -- and never runs code from a "
                                  "file. In Python, save state dicts (model.state_dict(), "
                                  "optimizer.state_dict()) rather than objects"));
}

// How many elements a call on `item` may visit: a container's size, 1 for anything else.
uint64_t visits(const Item& item) {
  if (item.raw != nullptr) return item.raw->size() + 1;
  const c10::IValue& v = item.value;
  if (v.isList()) return v.toListRef().size() + 1;
  if (v.isGenericDict()) return v.toGenericDict().size() + 1;
  if (v.isTuple()) return v.toTupleRef().elements().size() + 1;
  return 1;
}

absl::StatusOr<Item> call_global(Context& ctx, const Item& callable,
                                 const std::vector<Item>& args) {
  const int32_t g = callable.ref;
  for (const Item& a : args) ctx.work += visits(a);
  if (ctx.work > ctx.work_limit) {
    return ctx.data_loss(absl::StrCat(
        "its calls visit more than ", ctx.work_limit,
        " elements, far more than a "
        "pickle of its size needs (a hostile file repeating calls on one large value)"));
  }
  if (g >= kStorageClass && g < kDcpFirst)
    return ctx.invalid(absl::StrCat(global_name(g), " is called; storages come by persistent id"));
  switch (g) {
    case kRebuildTensorV2:
    case kRebuildTensor:
      return rebuild_tensor(ctx, g, args);
    case kRebuildParameter:
    case kRebuildParameterWithState: {
      if (absl::Status s =
              g == kRebuildParameter ? arity(ctx, g, args, 3, 3) : arity(ctx, g, args, 4, 4);
          !s.ok()) {
        return s;
      }
      if (!args[0].is_value() || !args[0].value.isTensor() || !args[1].is_value() ||
          !args[1].value.isBool()) {
        return ctx.data_loss("a Parameter's data is not a tensor or its requires_grad not a bool");
      }
      if (g == kRebuildParameterWithState) {
        const Item& state = args[3];
        const bool empty =
            state.is_value() && (state.value.isNone() || (state.value.isGenericDict() &&
                                                          state.value.toGenericDict().size() == 0));
        if (!empty)
          return ctx.invalid("a Parameter carries Python attributes, which dtrain does not read");
      }
      at::Tensor p = args[0].value.toTensor().detach();  // a new tensor over the same storage
      if (args[1].value.toBool()) {
        if (!p.is_floating_point() && !p.is_complex())
          return ctx.invalid("an integer Parameter requires grad");
        p.requires_grad_(true);
      }
      return Item::of(c10::IValue(std::move(p)));
    }
    case kRestoreTypeTag:
      return restore_type_tag(ctx, args);
    default:
      return call_small(ctx, g, args);
  }
}

}  // namespace dtrain::checkpoint::pickle_internal
