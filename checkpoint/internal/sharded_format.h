// Private to //checkpoint:sharded: what its save (sharded.cc) and load (sharded_load.cc) halves
// share -- the file names and format tag, and small helpers over the pickled values.
#ifndef DTRAIN_CHECKPOINT_INTERNAL_SHARDED_FORMAT_H_
#define DTRAIN_CHECKPOINT_INTERNAL_SHARDED_FORMAT_H_

#include <cstdint>
#include <functional>
#include <numeric>
#include <optional>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

namespace dtrain::checkpoint::sharded_internal {

using Dict = c10::impl::GenericDict;

inline constexpr char kMetadata[] = "metadata.pt";
inline constexpr char kFormat[] = "dtrain-sharded v1";

inline Dict str_dict() { return Dict(c10::StringType::get(), c10::AnyType::get()); }
inline Dict int_dict() { return Dict(c10::IntType::get(), c10::AnyType::get()); }

inline int64_t numel_of(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

// A list of ints as the file holds it: typed (List[int]) or not (List[Any], as from Python or
// dtrain's own writer); nullopt for anything else.
inline std::optional<std::vector<int64_t>> int_list(const c10::IValue& v) {
  if (!v.isList()) return std::nullopt;
  std::vector<int64_t> out;
  for (const c10::IValue& e : v.toListRef()) {
    if (!e.isInt()) return std::nullopt;
    out.push_back(e.toInt());
  }
  return out;
}

}  // namespace dtrain::checkpoint::sharded_internal

#endif  // DTRAIN_CHECKPOINT_INTERNAL_SHARDED_FORMAT_H_
