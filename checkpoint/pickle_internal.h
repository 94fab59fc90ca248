// Private to //checkpoint:pickle_reader: what the pickle machine (pickle_reader.cc,
// pickle_machine_objects.cc), the allow-listed globals (pickle_globals.cc), storages and tensors
// (pickle_tensors.cc) and the checks (pickle_checks.cc) share. Not a public header.
#ifndef DTRAIN_CHECKPOINT_PICKLE_INTERNAL_H_
#define DTRAIN_CHECKPOINT_PICKLE_INTERNAL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/pickle_reader.h"

namespace dtrain::checkpoint::pickle_internal {

// Nesting limit for containers in the result (and for tuples while reading): deeper files are
// refused rather than recursed into. State dicts nest a handful of levels.
inline constexpr uint32_t kMaxDepth = 1000;
// The result may expand (a shared value counted once per reference) to at most this many values.
inline constexpr uint64_t kMaxExpandedValues = uint64_t{1} << 28;

// The callables the allow-list knows. Storage classes are kStorageClass + the c10::ScalarType.
enum Global : int32_t {
  kOrderedDict,
  kRebuildTensorV2,
  kRebuildTensor,
  kRebuildParameter,
  kRebuildParameterWithState,
  kRestoreTypeTag,
  kBuildIntList,
  kBuildDoubleList,
  kBuildBoolList,
  kBuildTensorList,
  kTorchSize,
  kTorchDevice,
  kCodecsEncode,
  kStorageClass = 1000,
  kDcpFirst = 2000,  // the DCP dialect's globals (pickle_dcp.cc): kDcpFirst + their index
};

// One entry of the pickle stack or memo: a value, an allow-listed global, or a loaded storage.
struct Item {
  enum class Kind : uint8_t { kValue, kGlobal, kStorage };
  Kind kind = Kind::kValue;
  int32_t ref = 0;           // the Global (kGlobal) or an index into Context::storages (kStorage)
  uint32_t tuple_depth = 0;  // for tuples: 1 + the deepest tuple inside (lists and dicts count 0)
  c10::IValue value;         // kValue: the value; None for a tuple holding non-values (see raw)
  // A tuple holding globals or storages (a persistent id, REDUCE arguments): its elements.
  std::shared_ptr<const std::vector<Item>> raw;

  static Item of(c10::IValue v, uint32_t tuple_depth = 0) {
    Item item;
    item.value = std::move(v);
    item.tuple_depth = tuple_depth;
    return item;
  }
  static Item global(int32_t g) { return reference(Kind::kGlobal, g); }
  static Item storage(int32_t index) { return reference(Kind::kStorage, index); }
  static Item reference(Kind kind, int32_t ref) {
    Item item;
    item.kind = kind;
    item.ref = ref;
    return item;
  }
  bool is_value() const { return kind == Kind::kValue && raw == nullptr; }
  bool is_tuple() const { return kind == Kind::kValue && (raw != nullptr || value.isTuple()); }
};

// The elements of a tuple item (REQUIRES is_tuple()).
std::vector<Item> tuple_elements(const Item& tuple);

struct Context {
  Context(const std::string& name, const StorageLoader& loader, PickleDialect dialect)
      : name(name), load_storage(loader), dialect(dialect) {}

  absl::Status data_loss(
      std::string_view what) const;  // DataLoss: "<name>'s pickle, at byte N: what"
  absl::Status invalid(std::string_view what) const;  // InvalidArgument, same shape
  // A new empty Dict(Any, Any) / List(Any), remembered in `containers`.
  c10::IValue new_dict();
  c10::IValue new_list();

  const std::string& name;
  const StorageLoader& load_storage;
  const PickleDialect dialect;
  // kDcpMetadata: the dicts that stand for objects NEWOBJ made (by IValue::internalToPointer()).
  std::unordered_set<const void*> objects;
  size_t offset = 0;  // of the opcode being run
  struct Storage {
    at::Storage storage;
    at::ScalarType dtype;
    int64_t numel;
  };
  std::vector<Storage> storages;
  std::unordered_map<std::string, int32_t> storage_by_key;
  // Every list and dict made while reading. On failure they are cleared, which breaks any
  // reference cycle a hostile pickle built and keeps destruction shallow.
  std::vector<c10::IValue> containers;
  // Work budget: element visits by the allow-listed calls (each is linear in its arguments), so a
  // small pickle that calls them again and again on one large memoized value is refused instead of
  // taking hours or all memory. Legitimate pickles visit each element about once.
  uint64_t work = 0;
  uint64_t work_limit = 0;
};

// The allow-listed global `module.name`, or InvalidArgument naming it.
absl::StatusOr<Item> resolve_global(const Context& ctx, std::string_view module,
                                    std::string_view name);
// Calls `callable` (REQUIRES kind == kGlobal) with `args` (REDUCE).
absl::StatusOr<Item> call_global(Context& ctx, const Item& callable, const std::vector<Item>& args);
// BINPERSID: ('storage', <storage class>, key, location, numel) -> the storage, loaded once per
// key.
absl::StatusOr<Item> persistent_load(Context& ctx, const Item& pid);
// _rebuild_tensor_v2 or _rebuild_tensor (`g`) called with `a`: a CPU tensor over a loaded storage.
absl::StatusOr<Item> rebuild_tensor(Context& ctx, int32_t g, const std::vector<Item>& a);
// OK when global `g` is called with lo to hi arguments, else DataLoss naming it.
absl::Status arity(const Context& ctx, int32_t g, const std::vector<Item>& args, size_t lo,
                   size_t hi);
// The ints of `item`, a tuple or list of ints (a size, a stride); else DataLoss naming `what`.
absl::StatusOr<std::vector<int64_t>> ints(const Context& ctx, const Item& item, const char* what);
// Python's name for what `item` is, for messages ("a torch.FloatStorage class", "a str", ...).
std::string describe(const Item& item);

// The DCP dialect (pickle_dcp.cc; PickleDialect::kDcpMetadata only).
// DCP's allow-listed global `module.name`, or nullopt: a class or callable (kGlobal) or, for a
// torch dtype, its name as a str value.
std::optional<Item> resolve_dcp_global(std::string_view module, std::string_view name);
bool is_dcp_global(int32_t g);
std::string dcp_global_name(int32_t g);
// REDUCE of a DCP callable; NEWOBJ of a DCP class (an object: see pickle_reader.h).
absl::StatusOr<Item> call_dcp(Context& ctx, int32_t g, const std::vector<Item>& args);
absl::StatusOr<Item> new_dcp_object(Context& ctx, int32_t g, const std::vector<Item>& args);
// BUILD on a DCP object: its state merged into it.
absl::Status build_dcp_object(Context& ctx, const Item& target, const Item& state);
// Whether `v` is an object NEWOBJ made; an object as a dict key: a MetadataIndex as a str
// (pickle_reader.h).
bool is_dcp_object(const Context& ctx, const c10::IValue& v);
absl::StatusOr<Item> dcp_object_key(const Context& ctx, const c10::IValue& object);

// UTF-8 as Python's pickler writes it (surrogates allowed: it encodes with 'surrogatepass').
bool valid_utf8(std::string_view s);
// The name of an opcode Python defines but dtrain does not run, or nullptr.
const char* unsupported_name(uint8_t op);

// Checks what the pickle returns: no reference cycle, nesting within kMaxDepth, an expansion
// within kMaxExpandedValues. Recursion depth is bounded by kMaxDepth.
class ResultCheck {
 public:
  explicit ResultCheck(const Context& ctx) : ctx_(ctx) {}
  // Returns the height (1 for a leaf) of `v`, found `depth` levels below the root.
  absl::StatusOr<uint32_t> visit(const c10::IValue& v, uint32_t depth);
  // Whether a successful visit reached the container at `pointer` (IValue::internalToPointer()).
  bool reached(const void* pointer) const { return done_.count(pointer) != 0; }

 private:
  bool count(uint64_t n);
  absl::Status too_deep() const;
  absl::Status too_big() const;

  const Context& ctx_;
  uint64_t total_ = 0;
  std::unordered_set<const void*> on_path_;
  std::unordered_map<const void*, std::pair<uint32_t, uint64_t>> done_;  // height, expanded size
};

}  // namespace dtrain::checkpoint::pickle_internal

#endif  // DTRAIN_CHECKPOINT_PICKLE_INTERNAL_H_
