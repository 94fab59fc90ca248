// The pickle machine: the opcode reader's state (input, stack, marks, memo) and its small helpers
// for reading arguments and building values. Internal to //checkpoint:pickle_reader; its opcodes
// are run in pickle_reader.cc and pickle_machine_objects.cc.
#ifndef DTRAIN_CHECKPOINT_INTERNAL_PICKLE_MACHINE_H_
#define DTRAIN_CHECKPOINT_INTERNAL_PICKLE_MACHINE_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/pickle_internal.h"

namespace dtrain::checkpoint::pickle_internal {

// Reads one pickle: run() executes its opcodes up to STOP and returns the value they built.
class Machine {
 public:
  Machine(std::string_view pickle, Context& ctx) : p_(pickle), ctx_(ctx) {}

  absl::StatusOr<c10::IValue> run() {
    while (true) {
      ctx_.offset = pos_;
      if (pos_ >= p_.size())
        return ctx_.data_loss("the pickle ends without a STOP opcode (truncated)");
      const auto op = static_cast<uint8_t>(p_[pos_++]);
      if (op == '.') return stop();
      if (absl::Status s = step(op); !s.ok()) return s;
    }
  }

 private:
  // --- reading arguments ---
  absl::StatusOr<std::string_view> take(uint64_t n, const char* what) {
    if (n > p_.size() - pos_) {
      return ctx_.data_loss(
          absl::StrCat(what, " needs ", n, " bytes but only ", p_.size() - pos_, " remain"));
    }
    std::string_view v = p_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return v;
  }
  absl::StatusOr<uint64_t> le(int n, const char* what) {
    absl::StatusOr<std::string_view> b = take(static_cast<uint64_t>(n), what);
    if (!b.ok()) return b.status();
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i)
      v = (v << 8) | static_cast<unsigned char>((*b)[static_cast<size_t>(i)]);
    return v;
  }
  absl::StatusOr<std::string_view> line(const char* what) {
    const size_t nl = p_.find('\n', pos_);
    if (nl == std::string_view::npos)
      return ctx_.data_loss(absl::StrCat(what, "'s line has no end"));
    std::string_view v = p_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return v;
  }

  // --- the stack ---
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  absl::StatusOr<Item> pop(const char* op) {
    if (stack_.size() <= floor()) return ctx_.data_loss(absl::StrCat(op, " finds the stack empty"));
    Item item = std::move(stack_.back());
    stack_.pop_back();
    return item;
  }
  absl::StatusOr<Item*> top(const char* op) {
    if (stack_.size() <= floor()) return ctx_.data_loss(absl::StrCat(op, " finds the stack empty"));
    return &stack_.back();
  }
  absl::StatusOr<std::vector<Item>> pop_mark(const char* op) {
    if (marks_.empty()) return ctx_.data_loss(absl::StrCat(op, " finds no MARK"));
    std::vector<Item> items(
        std::make_move_iterator(stack_.begin() + static_cast<std::ptrdiff_t>(marks_.back())),
        std::make_move_iterator(stack_.end()));
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  absl::StatusOr<c10::IValue> plain(const Item& item, const char* where) {
    if (item.is_value()) return item.value;
    return ctx_.invalid(
        absl::StrCat(where, " holds ", describe(item), ", which cannot be stored in a state dict"));
  }
  absl::Status push_str(std::string_view s, bool utf8) {
    if (utf8 && !valid_utf8(s)) return ctx_.data_loss("a string is not valid UTF-8");
    stack_.push_back(Item::of(c10::IValue(std::string(s))));
    return absl::OkStatus();
  }
  absl::Status push_sized_str(int len_bytes, bool utf8, const char* what) {
    absl::StatusOr<uint64_t> n = le(len_bytes, what);
    if (!n.ok()) return n.status();
    // (BINSTRING's length is signed: a negative one reads as more than 2^31 bytes, refused by
    // take.)
    absl::StatusOr<std::string_view> s = take(*n, what);
    return s.ok() ? push_str(*s, utf8) : s.status();
  }
  // Two's complement little-endian integer of `bytes` (LONG1/LONG4), which must fit 64 bits.
  absl::Status push_long(std::string_view bytes) {
    const bool negative = !bytes.empty() && (static_cast<unsigned char>(bytes.back()) & 0x80) != 0;
    for (size_t i = 8; i < bytes.size(); ++i) {
      if (static_cast<unsigned char>(bytes[i]) != (negative ? 0xff : 0x00)) {
        return ctx_.invalid(
            absl::StrCat("an integer of ", bytes.size(), " bytes does not fit 64 bits"));
      }
    }
    if (bytes.size() > 8 &&
        (static_cast<unsigned char>(bytes[7]) & 0x80) != (negative ? 0x80 : 0)) {
      return ctx_.invalid("an integer does not fit 64 bits");
    }
    uint64_t v = negative ? ~uint64_t{0} : 0;
    for (size_t i = std::min<size_t>(bytes.size(), 8); i-- > 0;) {
      v = (v << 8) | static_cast<unsigned char>(bytes[i]);
    }
    stack_.push_back(Item::of(c10::IValue(static_cast<int64_t>(v))));
    return absl::OkStatus();
  }
  absl::Status push_tuple(std::vector<Item> items) {
    uint32_t depth = 0;
    bool values = true;
    for (const Item& item : items) {
      depth = std::max(depth, item.tuple_depth);
      values = values && item.is_value();
    }
    if (depth + 1 > kMaxDepth)
      return ctx_.data_loss(absl::StrCat("tuples nest deeper than ", kMaxDepth));
    Item t;
    t.tuple_depth = depth + 1;
    if (values) {
      std::vector<c10::IValue> elements;
      elements.reserve(items.size());
      for (Item& item : items) elements.push_back(std::move(item.value));
      t.value = c10::ivalue::Tuple::create(std::move(elements));
    } else {
      t.raw = std::make_shared<const std::vector<Item>>(std::move(items));
    }
    stack_.push_back(std::move(t));
    return absl::OkStatus();
  }
  absl::Status append(const Item& list_item, const Item& value) {
    if (!list_item.is_value() || !list_item.value.isList() ||
        list_item.value.toList().elementType()->kind() != c10::TypeKind::AnyType) {
      return ctx_.data_loss(absl::StrCat("APPEND(S) onto ", describe(list_item), ", not a list"));
    }
    absl::StatusOr<c10::IValue> v = plain(value, "a list");
    if (!v.ok()) return v.status();
    list_item.value.toList().push_back(std::move(*v));
    return absl::OkStatus();
  }
  // `key_made` marks a key dtrain made from a DCP object (dcp_object_key), hashable by
  // construction.
  absl::Status set_item(const Item& dict_item, const Item& key, const Item& value,
                        bool key_made = false) {
    if (!dict_item.is_value() || !dict_item.value.isGenericDict() ||
        dict_item.value.toGenericDict().keyType()->kind() != c10::TypeKind::AnyType ||
        dict_item.value.toGenericDict().valueType()->kind() != c10::TypeKind::AnyType) {
      return ctx_.data_loss(absl::StrCat("SETITEM(S) on ", describe(dict_item), ", not a dict"));
    }
    if (key.is_value() && is_dcp_object(ctx_, key.value)) {
      absl::StatusOr<Item> k = dcp_object_key(ctx_, key.value);
      return k.ok() ? set_item(dict_item, *k, value, /*key_made=*/true) : k.status();
    }
    const c10::IValue& k = key.value;
    if (!key_made && (!key.is_value() ||
                      !(k.isString() || k.isInt() || k.isDouble() || k.isBool() || k.isTensor()))) {
      return ctx_.invalid(
          absl::StrCat("a dict key is ", describe(key),
                       "; dtrain reads dict keys that are str, int, float, bool or tensors"));
    }
    absl::StatusOr<c10::IValue> v = plain(value, "a dict");
    if (!v.ok()) return v.status();
    if (dict_item.value.toGenericDict().contains(k)) {
      // Python never pickles a key twice (and 1, 1.0 and True are one key there).
      return ctx_.data_loss(absl::StrCat("a dict key occurs twice: ", describe(key)));
    }
    dict_item.value.toGenericDict().insert(k, std::move(*v));
    return absl::OkStatus();
  }
  absl::Status memo_put(uint64_t index) {
    absl::StatusOr<Item*> t = top("PUT");
    if (!t.ok()) return t.status();
    memo_[index] = **t;
    return absl::OkStatus();
  }
  absl::Status memo_get(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end())
      return ctx_.data_loss(absl::StrCat("GET of memo entry ", index, ", never stored"));
    stack_.push_back(it->second);
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> text_index(const char* what) {
    absl::StatusOr<std::string_view> l = line(what);
    uint64_t v = 0;
    if (!l.ok()) return l.status();
    if (!absl::SimpleAtoi(std::string(*l), &v))
      return ctx_.data_loss(absl::StrCat(what, " has a malformed index"));
    return v;
  }

  absl::Status step(uint8_t op);
  absl::Status step_stack(uint8_t op, bool* handled);
  absl::Status step_numbers(uint8_t op, bool* handled);
  absl::Status step_containers(uint8_t op, bool* handled);
  absl::Status push_marked_container(uint8_t op);
  absl::Status step_objects(uint8_t op, bool* handled);
  absl::Status build();
  absl::StatusOr<c10::IValue> stop();

  std::string_view p_;
  size_t pos_ = 0;
  Context& ctx_;
  std::vector<Item> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Item> memo_;
};

}  // namespace dtrain::checkpoint::pickle_internal

#endif  // DTRAIN_CHECKPOINT_INTERNAL_PICKLE_MACHINE_H_
