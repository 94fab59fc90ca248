// Checks shared by the pickle machine: UTF-8, opcode names, and the result's shape.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "checkpoint/pickle_internal.h"

namespace dtrain::checkpoint::pickle_internal {

const char* unsupported_name(uint8_t op) {
  switch (op) {
    case 'S':
      return "STRING (protocol 0 str)";
    case 'V':
      return "UNICODE (protocol 0 str)";
    case 'P':
      return "PERSID (protocol 0 persistent id)";
    case 'i':
      return "INST (creates an object)";
    case 'o':
      return "OBJ (creates an object)";
    case 0x92:
      return "NEWOBJ_EX (creates an object)";
    case 0x82:
      return "EXT1";
    case 0x83:
      return "EXT2";
    case 0x84:
      return "EXT4";
    case 0x8f:
      return "EMPTY_SET (sets are not read)";
    case 0x90:
      return "ADDITEMS (sets are not read)";
    case 0x91:
      return "FROZENSET (sets are not read)";
    case 0x96:
      return "BYTEARRAY8";
    case 0x97:
      return "NEXT_BUFFER (out-of-band buffers)";
    case 0x98:
      return "READONLY_BUFFER (out-of-band buffers)";
    default:
      return nullptr;
  }
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || n > s.size() - i) return false;
    uint32_t cp = n == 1 ? c : c & (0x7f >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3f);
    }
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) ||
        (n == 4 && (cp < 0x10000 || cp > 0x10ffff)))
      return false;
    i += n;
  }
  return true;
}

absl::StatusOr<uint32_t> ResultCheck::visit(const c10::IValue& v, uint32_t depth) {
  if (!(v.isList() || v.isGenericDict() || v.isTuple()))
    return count(1) ? absl::StatusOr<uint32_t>(1) : too_big();
  const void* id = v.internalToPointer();
  if (auto it = done_.find(id); it != done_.end()) {
    if (depth + it->second.first > kMaxDepth) return too_deep();
    return count(it->second.second) ? absl::StatusOr<uint32_t>(it->second.first) : too_big();
  }
  if (depth + 1 > kMaxDepth) return too_deep();
  if (!on_path_.insert(id).second)
    return ctx_.data_loss("a container contains itself (a reference cycle)");
  const uint64_t before = total_;
  uint32_t height = 0;
  auto child = [&](const c10::IValue& c) -> absl::Status {
    absl::StatusOr<uint32_t> h = visit(c, depth + 1);
    if (!h.ok()) return h.status();
    height = std::max(height, *h);
    return absl::OkStatus();
  };
  if (v.isList()) {
    for (const c10::IValue& c : v.toListRef()) {
      if (absl::Status s = child(c); !s.ok()) return s;
    }
  } else if (v.isTuple()) {
    for (const c10::IValue& c : v.toTupleRef().elements()) {
      if (absl::Status s = child(c); !s.ok()) return s;
    }
  } else {
    for (const auto& kv : v.toGenericDict()) {
      if (absl::Status s = child(kv.value()); !s.ok()) return s;
      if (!count(1)) return too_big();  // the key
    }
  }
  on_path_.erase(id);
  if (!count(1)) return too_big();
  done_.emplace(id, std::make_pair(height + 1, total_ - before));
  return height + 1;
}

bool ResultCheck::count(uint64_t n) {
  total_ += n;
  return total_ <= kMaxExpandedValues;
}

absl::Status ResultCheck::too_deep() const {
  return ctx_.data_loss(absl::StrCat("containers nest deeper than ", kMaxDepth, " levels"));
}

absl::Status ResultCheck::too_big() const {
  return ctx_.invalid(absl::StrCat("its shared references expand to more than ", kMaxExpandedValues,
                                   " values (containers referencing each other many times over)"));
}

}  // namespace dtrain::checkpoint::pickle_internal
