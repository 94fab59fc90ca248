// The pickle machine's run loop and its scalar, string, stack and memo opcodes (the Machine class
// is in internal/pickle_machine.h, container and object opcodes in pickle_machine_objects.cc).
// Globals, persistent ids and tensor rebuilds are in pickle_globals.cc and pickle_tensors.cc.
#include "checkpoint/pickle_reader.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/internal/pickle_machine.h"
#include "checkpoint/pickle_internal.h"

namespace dtrain::checkpoint {
namespace pickle_internal {
namespace {

constexpr size_t kMaxMarks = 100000;

}  // namespace

// PROTO and FRAME, the stack's marks, POP, POP_MARK and DUP, and the memo's PUT, GET and MEMOIZE.
absl::Status Machine::step_stack(uint8_t op, bool* handled) {
  *handled = true;
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
      *handled = false;
      return absl::OkStatus();
  }
}

// Integers (BININT*, LONG*, INT, LONG) and floats (FLOAT, BINFLOAT).
absl::Status Machine::step_numbers(uint8_t op, bool* handled) {
  *handled = true;
  absl::StatusOr<uint64_t> n;
  switch (op) {
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
    default:
      *handled = false;
      return absl::OkStatus();
  }
}

// One opcode: None, True, False and the strings here, every other group in its step_* function.
absl::Status Machine::step(uint8_t op) {
  switch (op) {
    case 'N':
      stack_.push_back(Item::of(c10::IValue()));
      return absl::OkStatus();
    case 0x88:
      stack_.push_back(Item::of(c10::IValue(true)));
      return absl::OkStatus();
    case 0x89:
      stack_.push_back(Item::of(c10::IValue(false)));
      return absl::OkStatus();
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
    default:
      break;
  }
  bool handled = false;
  if (absl::Status s = step_stack(op, &handled); !s.ok() || handled) return s;
  if (absl::Status s = step_numbers(op, &handled); !s.ok() || handled) return s;
  if (absl::Status s = step_containers(op, &handled); !s.ok() || handled) return s;
  if (absl::Status s = step_objects(op, &handled); !s.ok() || handled) return s;
  if (const char* name = unsupported_name(op)) {
    return ctx_.invalid(absl::StrCat("opcode ", name,
                                     " is not read by dtrain, which reads plain state dicts "
                                     "(tensors, numbers, strings, None, dicts, lists, tuples)"));
  }
  return ctx_.data_loss(absl::StrFormat("0x%02x is not a pickle opcode", op));
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

}  // namespace pickle_internal

namespace {

using pickle_internal::Context;
using pickle_internal::Machine;
using pickle_internal::ResultCheck;

}  // namespace

absl::StatusOr<c10::IValue> read_pickle(std::string_view pickle, const std::string& name_for_errors,
                                        const StorageLoader& load_storage, PickleDialect dialect) {
  Context ctx(name_for_errors, load_storage, dialect);
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
