// Storages and tensors for the pickle reader: persistent ids load storages (once per key), and
// torch._utils._rebuild_tensor(_v2) makes CPU tensors over them.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Storage.h>

#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/pickle_internal.h"

namespace dtrain::checkpoint::pickle_internal {
namespace {

bool attributes_or_none(const Item& item) {
  return item.is_value() && (item.value.isNone() || item.value.isGenericDict());
}

}  // namespace

// _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks[,
// metadata]) and _rebuild_tensor(storage, storage_offset, size, stride).
absl::StatusOr<Item> rebuild_tensor(Context& ctx, int32_t g, const std::vector<Item>& a) {
  const bool v2 = g == kRebuildTensorV2;
  if (absl::Status s = v2 ? arity(ctx, g, a, 6, 7) : arity(ctx, g, a, 4, 4); !s.ok()) return s;
  if (a[0].kind != Item::Kind::kStorage) {
    return ctx.data_loss(absl::StrCat("a tensor's storage is ", describe(a[0]), ", not a storage"));
  }
  const Context::Storage& st = ctx.storages[static_cast<size_t>(a[0].ref)];
  if (!a[1].is_value() || !a[1].value.isInt() || a[1].value.toInt() < 0) {
    return ctx.data_loss("a tensor's storage offset is not a non-negative int");
  }
  const int64_t offset = a[1].value.toInt();
  absl::StatusOr<std::vector<int64_t>> size = ints(ctx, a[2], "a tensor's size");
  if (!size.ok()) return size.status();
  absl::StatusOr<std::vector<int64_t>> stride = ints(ctx, a[3], "a tensor's stride");
  if (!stride.ok()) return stride.status();
  if (size->size() != stride->size()) {
    return ctx.data_loss(
        absl::StrCat("a tensor has ", size->size(), " sizes but ", stride->size(), " strides"));
  }
  // The highest element index the tensor reaches: offset + sum((size - 1) * stride), overflow-safe.
  int64_t numel = 1, last = offset;
  for (size_t d = 0; d < size->size(); ++d) {
    const int64_t n = (*size)[d], s = (*stride)[d];
    if (n < 0 || s < 0) return ctx.data_loss("a tensor has a negative size or stride");
    if (__builtin_mul_overflow(numel, n, &numel))
      return ctx.data_loss("a tensor's element count overflows");
  }
  for (size_t d = 0; d < size->size() && numel > 0; ++d) {
    int64_t reach = 0;
    if (__builtin_mul_overflow((*size)[d] - 1, (*stride)[d], &reach) ||
        __builtin_add_overflow(last, reach, &last)) {
      return ctx.data_loss("a tensor's extent overflows");
    }
  }
  if (numel > 0 && last >= st.numel) {
    return ctx.data_loss(absl::StrCat("a tensor reaches element ", last, " of a storage of ",
                                      st.numel, " elements (its size, stride or offset is wrong)"));
  }
  bool requires_grad = false;
  if (v2) {
    if (!a[4].is_value() || !a[4].value.isBool())
      return ctx.data_loss("a tensor's requires_grad is not a bool");
    requires_grad = a[4].value.toBool();
    if (!attributes_or_none(a[5]) || (a.size() == 7 && !attributes_or_none(a[6]))) {
      return ctx.data_loss("a tensor's backward hooks or metadata are not a dict");
    }
  }
  at::Tensor t;
  try {
    t = at::empty({0}, at::TensorOptions().dtype(st.dtype).device(at::kCPU));
    t.set_(st.storage, offset, *size, *stride);
  } catch (const std::exception& e) {
    return ctx.data_loss(
        absl::StrCat("LibTorch refuses a tensor: ", std::string(e.what()).substr(0, 200)));
  }
  if (requires_grad) {
    if (!at::isFloatingType(st.dtype) && !at::isComplexType(st.dtype)) {
      return ctx.invalid(
          absl::StrCat("a tensor of dtype ", c10::toString(st.dtype),
                       " requires grad, which only floating and complex tensors can"));
    }
    t.requires_grad_(true);
  }
  return Item::of(c10::IValue(std::move(t)));
}

absl::StatusOr<Item> persistent_load(Context& ctx, const Item& pid) {
  if (!pid.is_tuple())
    return ctx.data_loss(absl::StrCat("a persistent id is ", describe(pid), ", not a tuple"));
  const std::vector<Item> e = tuple_elements(pid);
  auto str = [](const Item& i) { return i.is_value() && i.value.isString(); };
  if (e.size() != 5 || !str(e[0]) || e[0].value.toStringRef() != "storage" ||
      e[1].kind != Item::Kind::kGlobal || e[1].ref < kStorageClass || e[1].ref >= kDcpFirst ||
      !str(e[2]) || !str(e[3]) || !e[4].is_value() || !e[4].value.isInt() ||
      e[4].value.toInt() < 0) {
    return ctx.data_loss(
        "a persistent id is not ('storage', torch.<Dtype>Storage, key, location, numel)");
  }
  const auto dtype = static_cast<at::ScalarType>(e[1].ref - kStorageClass);
  const std::string& key = e[2].value.toStringRef();
  if (auto it = ctx.storage_by_key.find(key); it != ctx.storage_by_key.end()) {
    if (ctx.storages[static_cast<size_t>(it->second)].dtype != dtype) {
      return ctx.data_loss(absl::StrCat("storage ", key.substr(0, 64), " is used with two dtypes"));
    }
    return Item::storage(it->second);
  }
  const int64_t numel = e[4].value.toInt();
  int64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(dtype)), &nbytes)) {
    return ctx.data_loss(absl::StrCat("storage ", key.substr(0, 64), "'s size overflows"));
  }
  absl::StatusOr<at::Storage> storage = ctx.load_storage(key, dtype, numel);
  if (!storage.ok()) return storage.status();
  if (static_cast<int64_t>(storage->nbytes()) < nbytes) {
    return ctx.data_loss(
        absl::StrCat("storage ", key.substr(0, 64), " is shorter than its ", numel, " elements"));
  }
  ctx.storages.push_back({std::move(*storage), dtype, numel});
  const auto index = static_cast<int32_t>(ctx.storages.size() - 1);
  ctx.storage_by_key.emplace(key, index);
  return Item::storage(index);
}

}  // namespace dtrain::checkpoint::pickle_internal
