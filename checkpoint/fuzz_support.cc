#include "checkpoint/fuzz_support.h"

#include <dirent.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/optimizer_state_dict.h"
#include "checkpoint/stored_zip.h"
#include "checkpoint/test_zip.h"
#include "checkpoint/torch_file_writer.h"

namespace dtrain::checkpoint::testing {

using Entries = std::vector<std::pair<std::string, std::string>>;
using namespace std::string_literals;

std::vector<std::string> torch_file_seeds() {
  std::vector<std::string> out;
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericDict s0(c10::StringType::get(), c10::AnyType::get());
  s0.insert("step", at::scalar_tensor(3.0));
  s0.insert("exp_avg", at::arange(6, at::kFloat).reshape({2, 3}));
  s0.insert("view", s0.at("exp_avg").toTensor().t());
  state.insert(int64_t{0}, s0);
  d.insert(kStateKey, state);
  c10::impl::GenericList groups(c10::AnyType::get());
  c10::impl::GenericDict g(c10::StringType::get(), c10::AnyType::get());
  g.insert("lr", 0.01);
  g.insert("betas", c10::ivalue::Tuple::create({c10::IValue(0.9), c10::IValue(0.999)}));
  g.insert("params", c10::List<int64_t>({0}));
  g.insert("name", std::string("group"));
  g.insert("flag", true);
  g.insert("none", c10::IValue());
  groups.push_back(g);
  d.insert(kParamGroupsKey, groups);
  d.insert("mask", at::arange(4).gt(1));
  d.insert("half", at::ones({3}, at::kHalf));
  out.push_back(*write_torch_file(d));
  const std::vector<char> libtorch = torch::jit::pickle_save(d);  // type tags, memo, typed lists
  out.emplace_back(libtorch.begin(), libtorch.end());
  // Protocol 4 framing, MEMOIZE, STACK_GLOBAL, SHORT_BINUNICODE, OrderedDict + BUILD, a Parameter.
  const std::string p4 =
      "\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x0b"
      "collections\x94\x8c\x0bOrderedDict\x94\x93\x94)R\x94"
      "(\x8c\x01w\x94\x8c\x0ctorch._utils\x94\x8c\x12_rebuild_parameter\x94\x93\x94h\x05\x8c\x12_"
      "rebuild_tensor_v2"
      "\x94\x93\x94((\x8c\x07storage\x94\x8c\x05torch\x94\x8c\x0c"
      "FloatStorage\x94\x93\x94\x8c\x01"
      "0\x94\x8c"
      "\x06"
      "cuda:0\x94K\x06t\x94QK\x00K\x02K\x03\x86\x94K\x03K\x01\x86\x94\x89h\x02)"
      "R\x94t\x94R\x94\x88h\x02)R"
      "\x94\x87\x94R\x94u}\x94\x8c\x09_metadata\x94}\x94sb."s;
  Entries e = {{"p4/data.pkl", p4},
               {"p4/byteorder", "little"},
               {"p4/data/0", std::string(24, '\x01')},
               {"p4/version", "3\n"}};
  out.push_back(make_zip(e));
  ZipOptions z64;
  z64.zip64 = true;
  out.push_back(make_zip(e, z64));
  if (const char* dir = std::getenv("DTRAIN_FUZZ_CORPUS"); dir != nullptr) {
    if (DIR* dp = ::opendir(dir)) {
      while (dirent* ent = ::readdir(dp)) {
        if (ent->d_name[0] == '.' || ent->d_type == DT_DIR) continue;
        std::ifstream in(absl::StrCat(dir, "/", ent->d_name), std::ios::binary);
        std::string bytes((std::istreambuf_iterator<char>(in)), {});
        if (!bytes.empty()) out.push_back(std::move(bytes));
      }
      ::closedir(dp);
    }
  }
  return out;
}

// Touches every byte of every tensor in `v` (so ASan sees any read past a storage).
namespace {
uint64_t touch(const c10::IValue& v, int depth) {
  uint64_t sum = 0;
  if (depth > 1100) return 0;
  if (v.isTensor()) {
    const at::Tensor c = v.toTensor().detach().contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < c.nbytes(); ++i) sum += p[i];
  } else if (v.isGenericDict()) {
    for (const auto& kv : v.toGenericDict())
      sum += touch(kv.key(), depth + 1) + touch(kv.value(), depth + 1);
  } else if (v.isList()) {
    for (const c10::IValue& x : v.toListRef()) sum += touch(x, depth + 1);
  } else if (v.isTuple()) {
    for (const c10::IValue& x : v.toTupleRef().elements()) sum += touch(x, depth + 1);
  }
  return sum;
}
}  // namespace

uint64_t touch_all(const c10::IValue& v) { return touch(v, 0); }

Entries entries_of(const std::string& zip) {
  Entries e;
  const absl::StatusOr<StoredZip> z = read_stored_zip(zip, "seed");
  if (!z.ok()) return e;
  for (const ZipEntry& x : z->entries) e.emplace_back(x.name, std::string(x.data));
  return e;
}

std::string with_pickle(const std::string& zip, const std::string& pickle) {
  Entries e = entries_of(zip);
  bool replaced = false;
  for (auto& [name, data] : e) {
    if (absl::EndsWith(name, "data.pkl")) {
      data = pickle;
      replaced = true;
    }
  }
  return replaced ? make_zip(e) : zip;
}

std::string pickle_of(const std::string& zip) {
  for (const auto& [name, data] : entries_of(zip)) {
    if (absl::EndsWith(name, "data.pkl")) return data;
  }
  return "";
}

bool same_values(const c10::IValue& a, const c10::IValue& b) {
  if (a.isTensor() || b.isTensor()) {
    return a.isTensor() && b.isTensor() && a.toTensor().dtype() == b.toTensor().dtype() &&
           a.toTensor().sizes() == b.toTensor().sizes() &&
           a.toTensor().strides() == b.toTensor().strides() && a.toTensor().equal(b.toTensor());
  }
  if (a.isGenericDict() || b.isGenericDict()) {
    if (!a.isGenericDict() || !b.isGenericDict()) return false;
    auto x = a.toGenericDict(), y = b.toGenericDict();
    if (x.size() != y.size()) return false;
    for (const auto& kv : x) {
      if (!y.contains(kv.key()) || !same_values(kv.value(), y.at(kv.key()))) return false;
    }
    return true;
  }
  if (a.isList() || a.isTuple() || b.isList() || b.isTuple()) {
    if (a.isList() != b.isList() || a.isTuple() != b.isTuple()) return false;
    const auto x = a.isList() ? a.toList().vec() : a.toTupleRef().elements().vec();
    const auto y = b.isList() ? b.toList().vec() : b.toTupleRef().elements().vec();
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (!same_values(x[i], y[i])) return false;
    }
    return true;
  }
  if (a.isDouble() && b.isDouble()) {
    const double x = a.toDouble(), y = b.toDouble();
    return std::memcmp(&x, &y, sizeof(x)) == 0;
  }
  return a == b;
}

}  // namespace dtrain::checkpoint::testing
