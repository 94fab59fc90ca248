// The pickle machine's container opcodes (tuples, lists, dicts) and object opcodes (globals,
// REDUCE/NEWOBJ, BUILD, persistent ids). The other opcodes are in pickle_reader.cc.
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/internal/pickle_machine.h"
#include "checkpoint/pickle_internal.h"

namespace dtrain::checkpoint::pickle_internal {

// LIST ('l'), DICT ('d'): a new container from the items above the mark.
absl::Status Machine::push_marked_container(uint8_t op) {
  absl::StatusOr<std::vector<Item>> items = pop_mark(op == 'l' ? "LIST" : "DICT");
  if (!items.ok()) return items.status();
  const Item container = Item::of(op == 'l' ? ctx_.new_list() : ctx_.new_dict());
  if (op == 'd' && items->size() % 2 != 0) return ctx_.data_loss("DICT has an odd number of items");
  for (size_t i = 0; i < items->size(); i += op == 'l' ? 1 : 2) {
    absl::Status s = op == 'l' ? append(container, (*items)[i])
                               : set_item(container, (*items)[i], (*items)[i + 1]);
    if (!s.ok()) return s;
  }
  stack_.push_back(container);
  return absl::OkStatus();
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
    case 'd':
      return push_marked_container(op);
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

// BUILD: a DCP object's state (the DCP dialect), else only the attribute state of an
// OrderedDict (a module state dict's _metadata), which is checked and dropped.
absl::Status Machine::build() {
  absl::StatusOr<Item> state = pop("BUILD");
  if (!state.ok()) return state.status();
  absl::StatusOr<Item*> target = top("BUILD");
  if (!target.ok()) return target.status();
  if ((*target)->is_value() && is_dcp_object(ctx_, (*target)->value))
    return build_dcp_object(ctx_, **target, *state);
  if (!(*target)->is_value() || !(*target)->value.isGenericDict()) {
    return ctx_.invalid(
        absl::StrCat("BUILD sets the state of ", describe(**target),
                     "; only an OrderedDict's attributes are accepted (and dropped)"));
  }
  auto attributes_only = [](const Item& s) {
    return s.is_value() && (s.value.isNone() || s.value.isGenericDict());
  };
  bool ok = attributes_only(*state);
  if (!ok && state->is_tuple()) {
    const std::vector<Item> parts = tuple_elements(*state);
    ok = parts.size() == 2 && attributes_only(parts[0]) && attributes_only(parts[1]);
  }
  if (!ok) return ctx_.data_loss("BUILD's state for an OrderedDict is not a dict of attributes");
  return absl::OkStatus();  // attributes such as _metadata have no place in an IValue dict
}

absl::Status Machine::step_objects(uint8_t op, bool* handled) {
  *handled = true;
  switch (op) {
    case 'c': {  // GLOBAL module\nname\n
      absl::StatusOr<std::string_view> module = line("GLOBAL");
      if (!module.ok()) return module.status();
      absl::StatusOr<std::string_view> name = line("GLOBAL");
      if (!name.ok()) return name.status();
      absl::StatusOr<Item> g = resolve_global(ctx_, *module, *name);
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
      absl::StatusOr<Item> g =
          resolve_global(ctx_, module->value.toStringRef(), name->value.toStringRef());
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
        return ctx_.data_loss(absl::StrCat("REDUCE/NEWOBJ calls ", describe(*callable)));
      }
      if (!args->is_tuple()) return ctx_.data_loss("REDUCE/NEWOBJ's arguments are not a tuple");
      absl::StatusOr<Item> result;
      if (op == 0x81 && ctx_.dialect == PickleDialect::kDcpMetadata &&
          is_dcp_global(callable->ref)) {
        result = new_dcp_object(ctx_, callable->ref, tuple_elements(*args));
      } else if (op == 0x81 && callable->ref != kOrderedDict) {
        return ctx_.invalid(absl::StrCat("NEWOBJ creates ", describe(*callable)));
      } else {
        result = call_global(ctx_, *callable, tuple_elements(*args));
      }
      if (!result.ok()) return result.status();
      stack_.push_back(std::move(*result));
      return absl::OkStatus();
    }
    case 'b':
      return build();
    case 'Q': {  // BINPERSID
      absl::StatusOr<Item> pid = pop("BINPERSID");
      if (!pid.ok()) return pid.status();
      absl::StatusOr<Item> storage = persistent_load(ctx_, *pid);
      if (!storage.ok()) return storage.status();
      stack_.push_back(std::move(*storage));
      return absl::OkStatus();
    }
    default:
      *handled = false;
      return absl::OkStatus();
  }
}

}  // namespace dtrain::checkpoint::pickle_internal
