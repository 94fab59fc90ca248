// The pickle reader's DCP dialect (PickleDialect::kDcpMetadata, pickle_reader.h): exactly the
// classes and values torch.distributed.checkpoint's .metadata holds, each mapped to code written
// here. Nothing is looked up by name beyond these tables.
#include <ATen/core/Dict.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/internal/dcp_dtypes.h"
#include "checkpoint/pickle_internal.h"

namespace dtrain::checkpoint::pickle_internal {
namespace {

constexpr char kMetadataModule[] = "torch.distributed.checkpoint.metadata";
constexpr char kFilesystemModule[] = "torch.distributed.checkpoint.filesystem";

struct DcpGlobal {
  const char* module;
  const char* name;
  bool is_class;  // made by NEWOBJ (an object); otherwise a callable REDUCE calls
};

// Index i is global kDcpFirst + i.
constexpr DcpGlobal kDcpGlobals[] = {
    {kMetadataModule, "Metadata", true},
    {kMetadataModule, "TensorStorageMetadata", true},
    {kMetadataModule, "BytesStorageMetadata", true},
    {kMetadataModule, "ChunkStorageMetadata", true},
    {kMetadataModule, "TensorProperties", true},
    {kMetadataModule, "MetadataIndex", true},
    {kMetadataModule, "StorageMeta", true},
    {kFilesystemModule, "_StorageInfo", true},
    {kMetadataModule, "_MEM_FORMAT_ENCODING", false},
    {"torch.serialization", "_get_layout", false},
    {"pathlib", "PosixPath", false},
    {"pathlib", "PurePosixPath", false},
    {"pathlib", "WindowsPath", false},
    {"pathlib._local", "PosixPath", false},  // Python 3.13 and later
    {"pathlib._local", "PurePosixPath", false},
    {"pathlib._local", "WindowsPath", false},
    // getattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT"): how Python 3.11 and later pickle an
    // Enum member (by name), as PyTorch 2.15 writes TensorProperties' memory format. Only that
    // class and its three member names are taken (call_dcp).
    {"builtins", "getattr", false},
};
constexpr int32_t kDcpCount = static_cast<int32_t>(std::size(kDcpGlobals));
constexpr int32_t kMemFormat = kDcpFirst + 8;
constexpr int32_t kGetLayout = kDcpFirst + 9;
constexpr int32_t kMetadataIndex = kDcpFirst + 5;
constexpr int32_t kGetattr = kDcpFirst + 16;
// _MEM_FORMAT_ENCODING's members and their values (torch/distributed/checkpoint/metadata.py).
constexpr std::pair<const char*, int64_t> kMemFormats[] = {
    {"TORCH_CONTIGUOUS_FORMAT", 0}, {"TORCH_CHANNELS_LAST", 1}, {"TORCH_PRESERVE_FORMAT", 2}};
constexpr char kClassKey[] = "__class__";
constexpr char kStateKey[] = "__state__";

bool is_str(const Item& item) { return item.is_value() && item.value.isString(); }

}  // namespace

bool is_dcp_global(int32_t g) { return g >= kDcpFirst && g < kDcpFirst + kDcpCount; }

std::string dcp_global_name(int32_t g) {
  const DcpGlobal& d = kDcpGlobals[g - kDcpFirst];
  return absl::StrCat(d.module, ".", d.name);
}

std::optional<Item> resolve_dcp_global(std::string_view module, std::string_view name) {
  for (int32_t i = 0; i < kDcpCount; ++i) {
    if (module == kDcpGlobals[i].module && name == kDcpGlobals[i].name)
      return Item::global(kDcpFirst + i);
  }
  if (module == "torch") {
    if (internal::dcp_dtype(name).has_value())
      return Item::of(c10::IValue("torch." + std::string(name)));
  }
  return std::nullopt;
}

absl::StatusOr<Item> call_dcp(Context& ctx, int32_t g, const std::vector<Item>& args) {
  const DcpGlobal& d = kDcpGlobals[g - kDcpFirst];
  if (d.is_class) {
    return ctx.invalid(absl::StrCat(dcp_global_name(g),
                                    " is called by REDUCE; DCP's pickler creates it by NEWOBJ"));
  }
  if (g == kMemFormat) {
    if (args.size() != 1 || !args[0].is_value() || !args[0].value.isInt() ||
        args[0].value.toInt() < 0 || args[0].value.toInt() > 2) {
      return ctx.data_loss("_MEM_FORMAT_ENCODING is called with something other than 0, 1 or 2");
    }
    return args[0];
  }
  if (g == kGetattr) {
    if (args.size() == 2 && args[0].kind == Item::Kind::kGlobal && args[0].ref == kMemFormat &&
        is_str(args[1])) {
      for (const auto& [name, value] : kMemFormats) {
        if (args[1].value.toStringRef() == name) return Item::of(c10::IValue(value));
      }
    }
    return ctx.invalid(
        "builtins.getattr is called on something other than a member of "
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING (the only attribute a DCP "
        ".metadata looks up): dtrain reads only DCP's metadata classes and never runs code from "
        "a file");
  }
  if (g == kGetLayout) {
    if (args.size() != 1 || !is_str(args[0]))
      return ctx.data_loss("torch.serialization._get_layout is called without one str");
    return args[0];
  }
  std::string path;  // pathlib: the parts joined
  for (const Item& a : args) {
    if (!is_str(a)) return ctx.data_loss(absl::StrCat(dcp_global_name(g), "'s parts are not str"));
    const std::string& part = a.value.toStringRef();
    if (!path.empty() && path.back() != '/') path.push_back('/');
    path += part;
  }
  return Item::of(c10::IValue(std::move(path)));
}

absl::StatusOr<Item> new_dcp_object(Context& ctx, int32_t g, const std::vector<Item>& args) {
  if (!kDcpGlobals[g - kDcpFirst].is_class)
    return ctx.invalid(absl::StrCat("NEWOBJ creates ", dcp_global_name(g), ", not a class"));
  if (!args.empty()) {
    return ctx.data_loss(absl::StrCat("NEWOBJ creates ", dcp_global_name(g), " with ", args.size(),
                                      " arguments; DCP's dataclasses take none"));
  }
  c10::IValue object = ctx.new_dict();
  object.toGenericDict().insert(kClassKey, kDcpGlobals[g - kDcpFirst].name);
  ctx.objects.insert(object.internalToPointer());
  return Item::of(std::move(object));
}

bool is_dcp_object(const Context& ctx, const c10::IValue& v) {
  return ctx.dialect == PickleDialect::kDcpMetadata && v.isGenericDict() &&
         ctx.objects.count(v.internalToPointer()) != 0;
}

absl::Status build_dcp_object(Context& ctx, const Item& target, const Item& state) {
  c10::impl::GenericDict object = target.value.toGenericDict();
  auto merge = [&](const c10::IValue& attributes) -> absl::Status {
    for (const auto& kv : attributes.toGenericDict()) {
      if (!kv.key().isString())
        return ctx.data_loss("BUILD's state names an attribute with something other than a str");
      if (object.contains(kv.key())) {
        return ctx.data_loss(absl::StrCat("BUILD sets attribute '",
                                          kv.key().toStringRef().substr(0, 64),
                                          "' of an object twice"));
      }
      object.insert(kv.key(), kv.value());
    }
    return absl::OkStatus();
  };
  if (!state.is_value()) return ctx.data_loss("BUILD's state holds a class or a storage");
  if (state.value.isGenericDict()) return merge(state.value);
  if (state.value.isTuple()) {
    const auto& parts = state.value.toTupleRef().elements();
    const bool slots = parts.size() == 2 && parts[1].isGenericDict() &&
                       (parts[0].isNone() || parts[0].isGenericDict());
    if (slots) {
      if (parts[0].isGenericDict()) {
        if (absl::Status s = merge(parts[0]); !s.ok()) return s;
      }
      return merge(parts[1]);
    }
  }
  if (object.contains(kStateKey)) return ctx.data_loss("BUILD sets an object's state twice");
  object.insert(kStateKey, state.value);
  return absl::OkStatus();
}

absl::StatusOr<Item> dcp_object_key(const Context& ctx, const c10::IValue& object) {
  const c10::impl::GenericDict d = object.toGenericDict();
  const std::string cls = d.at(kClassKey).toStringRef();
  if (cls != kDcpGlobals[kMetadataIndex - kDcpFirst].name) {
    return ctx.invalid(
        absl::StrCat("a dict key is a ", cls, "; DCP keys its storage data by MetadataIndex only"));
  }
  c10::IValue fqn;
  c10::IValue offset;  // None unless present
  for (const auto& kv : d) {
    const std::string& name = kv.key().toStringRef();
    if (name == kClassKey || name == "index") continue;  // Python's key equality skips index
    if (name == "fqn" && kv.value().isString()) {
      fqn = kv.value();
    } else if (name == "offset" && (kv.value().isNone() || kv.value().isTuple())) {
      if (kv.value().isTuple()) {
        for (const c10::IValue& e : kv.value().toTupleRef().elements()) {
          if (!e.isInt()) return ctx.data_loss("a MetadataIndex's offset holds a non-int");
        }
      }
      offset = kv.value();
    } else {
      return ctx.data_loss(absl::StrCat("a MetadataIndex key has attribute '", name.substr(0, 64),
                                        "' of the wrong kind"));
    }
  }
  if (!fqn.isString()) return ctx.data_loss("a MetadataIndex key has no fqn");
  // LibTorch's dicts hash str, not tuples: the key as one str (pickle_reader.h).
  std::string key = "\x01MetadataIndex\x01";
  if (offset.isNone()) {
    key += "None";
  } else {
    const auto& dims = offset.toTupleRef().elements();
    for (size_t i = 0; i < dims.size(); ++i) absl::StrAppend(&key, i ? "," : "", dims[i].toInt());
  }
  absl::StrAppend(&key, "\x01", fqn.toStringRef());
  return Item::of(c10::IValue(std::move(key)));
}

}  // namespace dtrain::checkpoint::pickle_internal
