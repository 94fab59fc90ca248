// The pickle machine: opcodes, stack, marks and memo. Globals, persistent ids and tensor rebuilds
// are in pickle_globals.cc.
#include "checkpoint/pickle_reader.h"

#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/pickle_internal.h"

namespace dtrain::checkpoint {
namespace {

using pickle_internal::Context;
using pickle_internal::Item;
using pickle_internal::kMaxDepth;
using pickle_internal::ResultCheck;
using pickle_internal::unsupported_name;
using pickle_internal::valid_utf8;

constexpr size_t kMaxMarks = 100000;

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
    return ctx_.invalid(absl::StrCat(where, " holds ", pickle_internal::describe(item),
                                     ", which cannot be stored in a state dict"));
  }
  absl::Status push_str(std::string_view s, bool utf8) {
    if (utf8 && !valid_utf8(s)) return ctx_.data_loss("a string is not valid UTF-8");
    stack_.push_back(Item::of(c10::IValue(std::string(s))));
    return absl::OkStatus();
  }
  absl::Status push_sized_str(int len_bytes, bool utf8, const char* what) {
    absl::StatusOr<uint64_t> n = le(len_bytes, what);
    if (!n.ok()) return n.status();
    // (BINSTRING's length is signed: a negative one reads as more than 2^31 bytes, refused by take.)
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
      return ctx_.data_loss(
          absl::StrCat("APPEND(S) onto ", pickle_internal::describe(list_item), ", not a list"));
    }
    absl::StatusOr<c10::IValue> v = plain(value, "a list");
    if (!v.ok()) return v.status();
    list_item.value.toList().push_back(std::move(*v));
    return absl::OkStatus();
  }
  absl::Status set_item(const Item& dict_item, const Item& key, const Item& value) {
    if (!dict_item.is_value() || !dict_item.value.isGenericDict() ||
        dict_item.value.toGenericDict().keyType()->kind() != c10::TypeKind::AnyType ||
        dict_item.value.toGenericDict().valueType()->kind() != c10::TypeKind::AnyType) {
      return ctx_.data_loss(
          absl::StrCat("SETITEM(S) on ", pickle_internal::describe(dict_item), ", not a dict"));
    }
    const c10::IValue& k = key.value;
    if (!key.is_value() ||
        !(k.isString() || k.isInt() || k.isDouble() || k.isBool() || k.isTensor())) {
      return ctx_.invalid(
          absl::StrCat("a dict key is ", pickle_internal::describe(key),
                       "; dtrain reads dict keys that are str, int, float, bool or tensors"));
    }
    absl::StatusOr<c10::IValue> v = plain(value, "a dict");
    if (!v.ok()) return v.status();
    if (dict_item.value.toGenericDict().contains(k)) {
      // Python never pickles a key twice (and 1, 1.0 and True are one key there).
      return ctx_.data_loss(
          absl::StrCat("a dict key occurs twice: ", pickle_internal::describe(key)));
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
  absl::Status step_containers(uint8_t op, bool* handled);
  absl::Status step_objects(uint8_t op, bool* handled);
  absl::StatusOr<c10::IValue> stop();

  std::string_view p_;
  size_t pos_ = 0;
  Context& ctx_;
  std::vector<Item> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Item> memo_;
};

absl::Status Machine::step(uint8_t op) {
  absl::StatusOr<uint64_t> n;
  switch (op) {
    case 0x80: {  // PROTO
      if (!(n = le(1, "PROTO")).ok()) return n.status();
      if (*n > 5)
        return ctx_.invalid(
            absl::StrCat("pickle protocol ", *n, " is newer than 5, the newest read"));
      return absl::OkStatus();
    }
    case 0x95: {  // FRAME: a length prefix for the opcodes that follow; nothing to do but check it
      if (!(n = le(8, "FRAME")).ok()) return n.status();
      if (*n > p_.size() - pos_)
        return ctx_.data_loss("a FRAME is longer than the bytes left (truncated)");
      return absl::OkStatus();
    }
    case '(':
      if (marks_.size() >= kMaxMarks)
        return ctx_.data_loss(absl::StrCat("more than ", kMaxMarks, " open MARKs"));
      marks_.push_back(stack_.size());
      return absl::OkStatus();
    case '0':  // POP (of the mark itself when nothing is above it, as Python does)
      if (stack_.size() > floor()) {
        stack_.pop_back();
        return absl::OkStatus();
      }
      return pop_mark("POP").status();
    case '1':
      return pop_mark("POP_MARK").status();
    case '2': {
      absl::StatusOr<Item*> t = top("DUP");
      if (!t.ok()) return t.status();
      stack_.push_back(**t);
      return absl::OkStatus();
    }
    case 'N':
      stack_.push_back(Item::of(c10::IValue()));
      return absl::OkStatus();
    case 0x88:
      stack_.push_back(Item::of(c10::IValue(true)));
      return absl::OkStatus();
    case 0x89:
      stack_.push_back(Item::of(c10::IValue(false)));
      return absl::OkStatus();
    case 'J':
    case 'K':
    case 'M': {
      const int width = op == 'J' ? 4 : op == 'K' ? 1 : 2;
      if (!(n = le(width, "BININT")).ok()) return n.status();
      const int64_t v = op == 'J'
                            ? static_cast<int64_t>(static_cast<int32_t>(static_cast<uint32_t>(*n)))
                            : static_cast<int64_t>(*n);
      stack_.push_back(Item::of(c10::IValue(v)));
      return absl::OkStatus();
    }
    case 0x8a:
    case 0x8b: {  // LONG1, LONG4
      if (!(n = le(op == 0x8a ? 1 : 4, "LONG")).ok()) return n.status();
      if (op == 0x8b && (*n >> 31) != 0) return ctx_.data_loss("LONG4 has a negative length");
      absl::StatusOr<std::string_view> b = take(*n, "LONG");
      return b.ok() ? push_long(*b) : b.status();
    }
    case 'I':
    case 'L': {  // INT, LONG: decimal text ("I01"/"I00" are protocol 0's True/False)
      absl::StatusOr<std::string_view> l = line(op == 'I' ? "INT" : "LONG");
      if (!l.ok()) return l.status();
      std::string_view text = *l;
      if (op == 'I' && (text == "01" || text == "00")) {
        stack_.push_back(Item::of(c10::IValue(text == "01")));
        return absl::OkStatus();
      }
      if (op == 'L' && !text.empty() && text.back() == 'L') text.remove_suffix(1);
      int64_t v = 0;
      if (!absl::SimpleAtoi(std::string(text), &v))
        return ctx_.invalid("a text integer is malformed or does not fit 64 bits");
      stack_.push_back(Item::of(c10::IValue(v)));
      return absl::OkStatus();
    }
    case 'F': {
      absl::StatusOr<std::string_view> l = line("FLOAT");
      double v = 0;
      if (!l.ok()) return l.status();
      if (!absl::SimpleAtod(std::string(*l), &v))
        return ctx_.data_loss("a FLOAT's text is malformed");
      stack_.push_back(Item::of(c10::IValue(v)));
      return absl::OkStatus();
    }
    case 'G': {  // BINFLOAT: big-endian IEEE 754
      absl::StatusOr<std::string_view> b = take(8, "BINFLOAT");
      if (!b.ok()) return b.status();
      uint64_t bits = 0;
      for (char c : *b) bits = (bits << 8) | static_cast<unsigned char>(c);
      double v;
      std::memcpy(&v, &bits, sizeof(v));
      stack_.push_back(Item::of(c10::IValue(v)));
      return absl::OkStatus();
    }
    case 'X':
      return push_sized_str(4, true, "BINUNICODE");
    case 0x8c:
      return push_sized_str(1, true, "SHORT_BINUNICODE");
    case 0x8d:
      return push_sized_str(8, true, "BINUNICODE8");
    case 'T':
      return push_sized_str(4, true, "BINSTRING");
    case 'U':
      return push_sized_str(1, true, "SHORT_BINSTRING");
    case 'B':
      return push_sized_str(4, false, "BINBYTES");
    case 'C':
      return push_sized_str(1, false, "SHORT_BINBYTES");
    case 0x8e:
      return push_sized_str(8, false, "BINBYTES8");
    case 'q':
    case 'r':
      return (n = le(op == 'q' ? 1 : 4, "BINPUT")).ok() ? memo_put(*n) : n.status();
    case 0x94:
      return memo_put(memo_.size());  // MEMOIZE
    case 'p':
      return (n = text_index("PUT")).ok() ? memo_put(*n) : n.status();
    case 'h':
    case 'j':
      return (n = le(op == 'h' ? 1 : 4, "BINGET")).ok() ? memo_get(*n) : n.status();
    case 'g':
      return (n = text_index("GET")).ok() ? memo_get(*n) : n.status();
    default:
      break;
  }
  bool handled = false;
  if (absl::Status s = step_containers(op, &handled); !s.ok() || handled) return s;
  if (absl::Status s = step_objects(op, &handled); !s.ok() || handled) return s;
  if (const char* name = unsupported_name(op)) {
    return ctx_.invalid(absl::StrCat("opcode ", name,
                                     " is not read by dtrain, which reads plain state dicts "
                                     "(tensors, numbers, strings, None, dicts, lists, tuples)"));
  }
  return ctx_.data_loss(absl::StrFormat("0x%02x is not a pickle opcode", op));
}

absl::Status Machine::step_containers(uint8_t op, bool* handled) {
  *handled = true;
  switch (op) {
    case '}':
      stack_.push_back(Item::of(ctx_.new_dict()));
      return absl::OkStatus();
    case ']':
      stack_.push_back(Item::of(ctx_.new_list()));
      return absl::OkStatus();
    case ')':
      return push_tuple({});
    case 't': {
      absl::StatusOr<std::vector<Item>> items = pop_mark("TUPLE");
      return items.ok() ? push_tuple(std::move(*items)) : items.status();
    }
    case 0x85:
    case 0x86:
    case 0x87: {  // TUPLE1..3
      const size_t k = op - 0x84u;
      if (stack_.size() < floor() + k)
        return ctx_.data_loss(absl::StrCat("TUPLE", k, " finds too few items"));
      std::vector<Item> items(
          std::make_move_iterator(stack_.end() - static_cast<std::ptrdiff_t>(k)),
          std::make_move_iterator(stack_.end()));
      stack_.resize(stack_.size() - k);
      return push_tuple(std::move(items));
    }
    case 'l':
    case 'd': {  // LIST, DICT: from the items above the mark
      absl::StatusOr<std::vector<Item>> items = pop_mark(op == 'l' ? "LIST" : "DICT");
      if (!items.ok()) return items.status();
      const Item container = Item::of(op == 'l' ? ctx_.new_list() : ctx_.new_dict());
      if (op == 'd' && items->size() % 2 != 0)
        return ctx_.data_loss("DICT has an odd number of items");
      for (size_t i = 0; i < items->size(); i += op == 'l' ? 1 : 2) {
        absl::Status s = op == 'l' ? append(container, (*items)[i])
                                   : set_item(container, (*items)[i], (*items)[i + 1]);
        if (!s.ok()) return s;
      }
      stack_.push_back(container);
      return absl::OkStatus();
    }
    case 'a': {
      absl::StatusOr<Item> v = pop("APPEND");
      if (!v.ok()) return v.status();
      absl::StatusOr<Item*> list = top("APPEND");
      return list.ok() ? append(**list, *v) : list.status();
    }
    case 'e': {
      absl::StatusOr<std::vector<Item>> items = pop_mark("APPENDS");
      if (!items.ok()) return items.status();
      absl::StatusOr<Item*> list = top("APPENDS");
      if (!list.ok()) return list.status();
      for (const Item& item : *items) {
        if (absl::Status s = append(**list, item); !s.ok()) return s;
      }
      return absl::OkStatus();
    }
    case 's': {
      absl::StatusOr<Item> v = pop("SETITEM");
      if (!v.ok()) return v.status();
      absl::StatusOr<Item> k = pop("SETITEM");
      if (!k.ok()) return k.status();
      absl::StatusOr<Item*> dict = top("SETITEM");
      return dict.ok() ? set_item(**dict, *k, *v) : dict.status();
    }
    case 'u': {
      absl::StatusOr<std::vector<Item>> items = pop_mark("SETITEMS");
      if (!items.ok()) return items.status();
      if (items->size() % 2 != 0) return ctx_.data_loss("SETITEMS has an odd number of items");
      absl::StatusOr<Item*> dict = top("SETITEMS");
      if (!dict.ok()) return dict.status();
      for (size_t i = 0; i < items->size(); i += 2) {
        if (absl::Status s = set_item(**dict, (*items)[i], (*items)[i + 1]); !s.ok()) return s;
      }
      return absl::OkStatus();
    }
    default:
      *handled = false;
      return absl::OkStatus();
  }
}

absl::Status Machine::step_objects(uint8_t op, bool* handled) {
  *handled = true;
  switch (op) {
    case 'c': {  // GLOBAL module\nname\n
      absl::StatusOr<std::string_view> module = line("GLOBAL");
      if (!module.ok()) return module.status();
      absl::StatusOr<std::string_view> name = line("GLOBAL");
      if (!name.ok()) return name.status();
      absl::StatusOr<Item> g = pickle_internal::resolve_global(ctx_, *module, *name);
      if (!g.ok()) return g.status();
      stack_.push_back(std::move(*g));
      return absl::OkStatus();
    }
    case 0x93: {  // STACK_GLOBAL
      absl::StatusOr<Item> name = pop("STACK_GLOBAL");
      if (!name.ok()) return name.status();
      absl::StatusOr<Item> module = pop("STACK_GLOBAL");
      if (!module.ok()) return module.status();
      if (!module->is_value() || !module->value.isString() || !name->is_value() ||
          !name->value.isString()) {
        return ctx_.data_loss("STACK_GLOBAL's module and name are not strings");
      }
      absl::StatusOr<Item> g = pickle_internal::resolve_global(ctx_, module->value.toStringRef(),
                                                               name->value.toStringRef());
      if (!g.ok()) return g.status();
      stack_.push_back(std::move(*g));
      return absl::OkStatus();
    }
    case 'R':
    case 0x81: {  // REDUCE callable(*args); NEWOBJ cls.__new__(cls, *args)
      absl::StatusOr<Item> args = pop(op == 'R' ? "REDUCE" : "NEWOBJ");
      if (!args.ok()) return args.status();
      absl::StatusOr<Item> callable = pop(op == 'R' ? "REDUCE" : "NEWOBJ");
      if (!callable.ok()) return callable.status();
      if (callable->kind != Item::Kind::kGlobal) {
        return ctx_.data_loss(
            absl::StrCat("REDUCE/NEWOBJ calls ", pickle_internal::describe(*callable)));
      }
      if (!args->is_tuple()) return ctx_.data_loss("REDUCE/NEWOBJ's arguments are not a tuple");
      if (op == 0x81 && callable->ref != pickle_internal::kOrderedDict) {
        return ctx_.invalid(absl::StrCat("NEWOBJ creates ", pickle_internal::describe(*callable)));
      }
      absl::StatusOr<Item> result =
          pickle_internal::call_global(ctx_, *callable, pickle_internal::tuple_elements(*args));
      if (!result.ok()) return result.status();
      stack_.push_back(std::move(*result));
      return absl::OkStatus();
    }
    case 'b': {  // BUILD: only the attribute state of an OrderedDict (a module state dict's _metadata)
      absl::StatusOr<Item> state = pop("BUILD");
      if (!state.ok()) return state.status();
      absl::StatusOr<Item*> target = top("BUILD");
      if (!target.ok()) return target.status();
      if (!(*target)->is_value() || !(*target)->value.isGenericDict()) {
        return ctx_.invalid(
            absl::StrCat("BUILD sets the state of ", pickle_internal::describe(**target),
                         "; only an OrderedDict's attributes are accepted (and dropped)"));
      }
      auto attributes_only = [](const Item& s) {
        return s.is_value() && (s.value.isNone() || s.value.isGenericDict());
      };
      bool ok = attributes_only(*state);
      if (!ok && state->is_tuple()) {
        const std::vector<Item> parts = pickle_internal::tuple_elements(*state);
        ok = parts.size() == 2 && attributes_only(parts[0]) && attributes_only(parts[1]);
      }
      if (!ok)
        return ctx_.data_loss("BUILD's state for an OrderedDict is not a dict of attributes");
      return absl::OkStatus();  // attributes such as _metadata have no place in an IValue dict
    }
    case 'Q': {  // BINPERSID
      absl::StatusOr<Item> pid = pop("BINPERSID");
      if (!pid.ok()) return pid.status();
      absl::StatusOr<Item> storage = pickle_internal::persistent_load(ctx_, *pid);
      if (!storage.ok()) return storage.status();
      stack_.push_back(std::move(*storage));
      return absl::OkStatus();
    }
    default:
      *handled = false;
      return absl::OkStatus();
  }
}

absl::StatusOr<c10::IValue> Machine::stop() {
  absl::StatusOr<Item> result = pop("STOP");
  if (!result.ok()) return result.status();
  if (!stack_.empty() || !marks_.empty()) {
    return ctx_.data_loss(
        absl::StrCat("STOP leaves ", stack_.size(), " items and ", marks_.size(), " marks behind"));
  }
  if (pos_ != p_.size())
    return ctx_.data_loss(absl::StrCat(p_.size() - pos_, " bytes follow the STOP opcode"));
  return plain(*result, "the pickle's result");
}

}  // namespace

absl::StatusOr<c10::IValue> read_pickle(std::string_view pickle, const std::string& name_for_errors,
                                        const StorageLoader& load_storage) {
  Context ctx(name_for_errors, load_storage);
  ctx.work_limit = 8 * static_cast<uint64_t>(pickle.size()) + (uint64_t{1} << 20);
  absl::StatusOr<c10::IValue> result;
  {
    Machine machine(pickle, ctx);
    ResultCheck check(ctx);
    try {
      result = machine.run();
      if (result.ok()) {
        if (absl::StatusOr<uint32_t> height = check.visit(*result, 0); !height.ok())
          result = height.status();
      }
    } catch (const std::exception&
                 e) {  // LibTorch calls (tensor rebuilds) are guarded; this is a backstop
      result =
          ctx.data_loss(absl::StrCat("reading failed: ", std::string(e.what()).substr(0, 300)));
    }
    // Empty every list and dict the result does not hold (all of them on failure): breaks any cycle
    // and any deep chain a hostile pickle built, before the stack and memo are destroyed.
    for (const c10::IValue& c : ctx.containers) {
      if (result.ok() && check.reached(c.internalToPointer())) continue;
      if (c.isList()) c.toList().clear();
      if (c.isGenericDict()) c.toGenericDict().clear();
    }
  }
  return result;
}

}  // namespace dtrain::checkpoint
