#include "checkpoint/container_types.h"

#include <unordered_set>
#include <vector>

namespace dtrain::checkpoint {
namespace {

// The type of a leaf value a container can be typed by; null for anything else.
c10::TypePtr leaf_type(const c10::IValue& v) {
  if (v.isTensor()) return c10::TensorType::get();
  if (v.isInt()) return c10::IntType::get();
  if (v.isDouble()) return c10::FloatType::get();
  if (v.isBool()) return c10::BoolType::get();
  if (v.isString()) return c10::StringType::get();
  return nullptr;
}

// Folds one more value into the common type so far; `ok` goes false at the first mismatch.
void fold(c10::TypePtr& common, bool& ok, const c10::IValue& v) {
  if (!ok) return;
  c10::TypePtr t = leaf_type(v);
  if (t == nullptr || (common != nullptr && *common != *t)) {
    ok = false;
  } else {
    common = t;
  }
}

}  // namespace

void type_homogeneous_containers(const c10::IValue& root) {
  std::unordered_set<const void*> seen;
  std::vector<c10::IValue> pending = {root};
  while (!pending.empty()) {
    const c10::IValue v = pending.back();
    pending.pop_back();
    if (!(v.isList() || v.isGenericDict() || v.isTuple())) continue;
    if (!seen.insert(v.internalToPointer()).second) continue;
    if (v.isTuple()) {
      for (const c10::IValue& e : v.toTupleRef().elements()) pending.push_back(e);
    } else if (v.isList()) {
      c10::impl::GenericList l = v.toList();
      c10::TypePtr common;
      bool ok = !l.empty() && l.elementType()->kind() == c10::TypeKind::AnyType;
      for (size_t i = 0; i < l.size(); ++i) {
        c10::IValue e = l.get(i);
        fold(common, ok, e);
        pending.push_back(std::move(e));
      }
      if (ok) l.unsafeSetElementType(common);
    } else {
      c10::impl::GenericDict d = v.toGenericDict();
      c10::TypePtr key, value;
      bool key_ok = !d.empty() && d.keyType()->kind() == c10::TypeKind::AnyType;
      bool value_ok = !d.empty() && d.valueType()->kind() == c10::TypeKind::AnyType;
      for (const auto& kv : d) {
        fold(key, key_ok, kv.key());
        fold(value, value_ok, kv.value());
        pending.push_back(kv.value());
      }
      if (key_ok) d.unsafeSetKeyType(key);
      if (value_ok) d.unsafeSetValueType(value);
    }
  }
}

}  // namespace dtrain::checkpoint
