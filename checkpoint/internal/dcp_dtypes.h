// The tensor dtypes DCP files hold, as PyTorch names them (torch.<name> in .metadata's pickle):
// the one table the .metadata reader, its pickle resolver and its writer share.
#ifndef DTRAIN_CHECKPOINT_INTERNAL_DCP_DTYPES_H_
#define DTRAIN_CHECKPOINT_INTERNAL_DCP_DTYPES_H_

#include <optional>
#include <string_view>
#include <utility>

#include <c10/core/ScalarType.h>

namespace dtrain::checkpoint::internal {

inline constexpr std::pair<const char*, c10::ScalarType> kDcpDtypes[] = {
    {"float32", c10::kFloat},
    {"float64", c10::kDouble},
    {"float16", c10::kHalf},
    {"bfloat16", c10::kBFloat16},
    {"int64", c10::kLong},
    {"int32", c10::kInt},
    {"int16", c10::kShort},
    {"int8", c10::kChar},
    {"uint8", c10::kByte},
    {"bool", c10::kBool},
    {"complex64", c10::kComplexFloat},
    {"complex128", c10::kComplexDouble},
};

// "bfloat16" -> kBFloat16; nullopt for a name DCP files do not hold.
inline std::optional<c10::ScalarType> dcp_dtype(std::string_view name) {
  for (const auto& [n, t] : kDcpDtypes) {
    if (name == n) return t;
  }
  return std::nullopt;
}

// kBFloat16 -> "bfloat16"; nullptr for a dtype DCP files do not hold.
inline const char* dcp_dtype_name(c10::ScalarType dtype) {
  for (const auto& [n, t] : kDcpDtypes) {
    if (dtype == t) return n;
  }
  return nullptr;
}

}  // namespace dtrain::checkpoint::internal

#endif  // DTRAIN_CHECKPOINT_INTERNAL_DCP_DTYPES_H_
