#include "checkpoint/torch_file_reader.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/stored_zip.h"
#include "checkpoint/test_zip.h"
#include "checkpoint/torch_file_writer.h"

namespace dtrain::checkpoint {
namespace {

using ::testing::HasSubstr;
using Dict = c10::impl::GenericDict;
using Entries = std::vector<std::pair<std::string, std::string>>;

// Equal values of equal IValue types (the type strings compared, so Dict(Any, Any) differs from
// Dict(str, Tensor)); tensors equal in dtype, geometry, requires_grad and bytes.
::testing::AssertionResult same(const c10::IValue& a, const c10::IValue& b,
                                const std::string& path = "") {
  if (a.tagKind() != b.tagKind())
    return ::testing::AssertionFailure() << path << ": " << a.tagKind() << " vs " << b.tagKind();
  if (!a.isTensor() && a.type()->str() != b.type()->str()) {
    return ::testing::AssertionFailure()
           << path << ": type " << a.type()->str() << " vs " << b.type()->str();
  }
  if (a.isTensor()) {
    const at::Tensor x = a.toTensor(), y = b.toTensor();
    if (x.dtype() != y.dtype() || x.sizes() != y.sizes() || x.strides() != y.strides() ||
        x.storage_offset() != y.storage_offset() || x.requires_grad() != y.requires_grad() ||
        !x.device().is_cpu() || !x.detach().equal(y.detach())) {
      return ::testing::AssertionFailure() << path << ": tensors differ: " << x.toString()
                                           << x.sizes() << " vs " << y.toString() << y.sizes();
    }
    return ::testing::AssertionSuccess();
  }
  if (a.isGenericDict()) {
    Dict x = a.toGenericDict(), y = b.toGenericDict();
    if (x.size() != y.size()) return ::testing::AssertionFailure() << path << ": dict sizes differ";
    auto i = x.begin();
    auto j = y.begin();
    for (; i != x.end(); ++i, ++j) {  // same order too
      auto k = same(i->key(), j->key(), path + "/key");
      if (!k) return k;
      auto v = same(i->value(), j->value(),
                    path + "/" + (i->key().isString() ? i->key().toStringRef() : "?"));
      if (!v) return v;
    }
    return ::testing::AssertionSuccess();
  }
  if (a.isList() || a.isTuple()) {
    const std::vector<c10::IValue> x =
        a.isList() ? a.toList().vec() : a.toTupleRef().elements().vec();
    const std::vector<c10::IValue> y =
        b.isList() ? b.toList().vec() : b.toTupleRef().elements().vec();
    if (x.size() != y.size()) return ::testing::AssertionFailure() << path << ": lengths differ";
    for (size_t i = 0; i < x.size(); ++i) {
      auto r = same(x[i], y[i], absl::StrCat(path, "/", i));
      if (!r) return r;
    }
    return ::testing::AssertionSuccess();
  }
  if (a.isDouble()) {  // bit-exact, NaN included
    const double x = a.toDouble(), y = b.toDouble();
    return std::memcmp(&x, &y, sizeof(x)) == 0
               ? ::testing::AssertionSuccess()
               : ::testing::AssertionFailure() << path << ": " << x << " vs " << y;
  }
  return a == b ? ::testing::AssertionSuccess()
                : ::testing::AssertionFailure() << path << ": values differ";
}

c10::IValue every_kind_of_value() {
  Dict d(c10::StringType::get(), c10::AnyType::get());
  const std::vector<at::ScalarType> dtypes = {
      at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong,         at::kInt,
      at::kShort, at::kChar,   at::kByte, at::kBool,     at::kComplexFloat, at::kComplexDouble};
  Dict tensors(c10::StringType::get(), c10::AnyType::get());
  for (at::ScalarType t : dtypes) {
    tensors.insert(c10::toString(t), at::arange(12, at::kDouble).reshape({3, 4}).sub(5).to(t));
  }
  d.insert("tensors", tensors);
  at::Tensor base = at::arange(24, at::kFloat);
  d.insert("view_a", base.narrow(0, 2, 6).view({2, 3}));
  d.insert("view_b", base.view({4, 6}).t());  // non-contiguous, same storage
  d.insert("strided", at::arange(30, at::kDouble).reshape({5, 6}).slice(1, 1, 6, 2));
  d.insert("empty", at::empty({0, 3}, at::kFloat));
  d.insert("scalar", at::scalar_tensor(3.5, at::kFloat));
  d.insert("grad", at::ones({2}, at::kFloat).requires_grad_(true));
  c10::impl::GenericList mixed(c10::AnyType::get());
  mixed.push_back(int64_t{-(int64_t{1} << 62)});
  mixed.push_back(std::numeric_limits<double>::quiet_NaN());
  mixed.push_back(-0.0);
  mixed.push_back(std::string("\xe4\xb8\xad"));
  mixed.push_back(c10::IValue());
  mixed.push_back(c10::ivalue::Tuple::create({c10::IValue(true), c10::IValue(int64_t{7})}));
  d.insert("mixed", mixed);
  d.insert("ints", c10::List<int64_t>({1, 2, 3}));
  d.insert("doubles", c10::List<double>({0.5, 1.5}));
  d.insert("bools", c10::List<bool>({true, false}));
  Dict by_int(c10::IntType::get(), c10::AnyType::get());
  by_int.insert(int64_t{0}, std::string("zero"));
  d.insert("by_int", by_int);
  Dict typed(c10::StringType::get(), c10::TensorType::get());
  typed.insert("w", at::ones({2}));
  d.insert("typed", typed);
  return d;
}

TEST(TorchFileReaderTest, ReadsLibTorchPickleSaveFilesAsLibTorchDoes) {
  const c10::IValue v = every_kind_of_value();
  const std::vector<char> saved = torch::jit::pickle_save(v);
  const std::string_view bytes(saved.data(), saved.size());
  absl::StatusOr<c10::IValue> ours = read_torch_file(bytes, "file libtorch.pt");
  ASSERT_TRUE(ours.ok()) << ours.status();
  EXPECT_TRUE(same(*ours, torch::jit::pickle_load(saved)));
  EXPECT_TRUE(same(*ours, v));  // LibTorch's type tags restore every type
  const Dict d = ours->toGenericDict();
  EXPECT_TRUE(d.at("view_a").toTensor().storage().is_alias_of(d.at("view_b").toTensor().storage()));
}

TEST(TorchFileReaderTest, ReadsDtrainWriterFilesAsLibTorchDoes) {
  const c10::IValue v = every_kind_of_value();
  absl::StatusOr<std::string> bytes = write_torch_file(v);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<c10::IValue> ours = read_torch_file(*bytes, "file dtrain.pt");
  ASSERT_TRUE(ours.ok()) << ours.status();
  EXPECT_TRUE(
      same(*ours, torch::jit::pickle_load(std::vector<char>(bytes->begin(), bytes->end()))));
  const Dict d = ours->toGenericDict();
  EXPECT_EQ(d.at("by_int").toGenericDict().keyType()->str(),
            "Any");  // untyped, as from Python files
  EXPECT_TRUE(d.at("view_a").toTensor().storage().is_alias_of(d.at("view_b").toTensor().storage()));
  EXPECT_TRUE(d.at("grad").toTensor().requires_grad());
  // Nothing aliases the file's bytes.
  std::string copy = *bytes;
  absl::StatusOr<c10::IValue> again = read_torch_file(copy, "file dtrain.pt");
  ASSERT_TRUE(again.ok());
  std::fill(copy.begin(), copy.end(), '\xff');
  EXPECT_TRUE(same(*again, *ours));
}

// The entries of a write_torch_file file holding {"w": arange(6) as float, "b": a bool tensor}.
Entries sample_entries() {
  Dict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("w", at::arange(6, at::kFloat));
  d.insert("b", at::arange(3).gt(0));
  const std::string bytes = *write_torch_file(d);
  Entries out;
  const absl::StatusOr<StoredZip> zip = read_stored_zip(bytes, "sample");
  for (const ZipEntry& e : zip->entries) out.emplace_back(e.name, std::string(e.data));
  return out;
}

Entries renamed(const Entries& in, const std::string& from, const std::string& to) {
  Entries out;
  for (const auto& [n, d] : in)
    out.emplace_back(n.substr(0, from.size()) == from ? to + n.substr(from.size()) : n, d);
  return out;
}

TEST(TorchFileReaderTest, WithAnOwnerTensorsAreViewsThatKeepTheBytesAlive) {
  const c10::IValue v = every_kind_of_value();
  absl::StatusOr<std::string> written = write_torch_file(v);
  ASSERT_TRUE(written.ok()) << written.status();
  auto owner = std::make_shared<std::string>(*written);
  TorchFileReadOptions options;
  options.owner = owner;
  absl::StatusOr<c10::IValue> ours = read_torch_file(*owner, "file dtrain.pt", options);
  ASSERT_TRUE(ours.ok()) << ours.status();
  const c10::IValue expected =
      torch::jit::pickle_load(std::vector<char>(owner->begin(), owner->end()));
  const char* data =
      static_cast<const char*>(ours->toGenericDict().at("view_a").toTensor().storage().data());
  EXPECT_TRUE(data >= owner->data() && data < owner->data() + owner->size())
      << "not a view into the bytes";
  EXPECT_GT(owner.use_count(), 1);  // the tensors hold the bytes
  std::weak_ptr<std::string> weak = owner;
  owner.reset();
  options.owner.reset();
  EXPECT_FALSE(weak.expired());
  EXPECT_TRUE(same(*ours, expected));
  ours = absl::StatusOr<c10::IValue>(c10::IValue());
  EXPECT_TRUE(weak.expired()) << "the bytes outlived every tensor";
}

TEST(TorchFileReaderTest, AnyArchivePrefixAndZip64) {
  const Entries entries = renamed(sample_entries(), "archive/", "adam_state/");
  testing::ZipOptions o;
  o.zip64 = true;
  for (const std::string& zip : {testing::make_zip(entries), testing::make_zip(entries, o)}) {
    absl::StatusOr<c10::IValue> v = read_torch_file(zip, "file adam_state.pt");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_TRUE(v->toGenericDict().at("w").toTensor().equal(at::arange(6, at::kFloat)));
  }
}

absl::Status read_entries(const Entries& entries) {
  return read_torch_file(testing::make_zip(entries), "file x.pt").status();
}

Entries with(Entries entries, const std::string& name, const std::string& data) {
  for (auto& [n, d] : entries) {
    if (n == name) {
      d = data;
      return entries;
    }
  }
  entries.emplace_back(name, data);
  return entries;
}

TEST(TorchFileReaderTest, ArchiveLayoutErrors) {
  const Entries good = sample_entries();
  ASSERT_TRUE(read_entries(good).ok());
  struct Case {
    Entries entries;
    absl::StatusCode code;
    std::string message;
  };
  Entries no_storage;
  for (const auto& e : good) {
    if (e.first != "archive/data/0") no_storage.push_back(e);
  }
  const std::vector<Case> cases = {
      {renamed(good, "archive/data.pkl", "archive/other.pkl"), absl::StatusCode::kInvalidArgument,
       "file x.pt is a zip archive without a <name>/data.pkl entry"},
      {with(good, "archive/constants.pkl", ""), absl::StatusCode::kInvalidArgument,
       "is a TorchScript module archive (torch.jit.save)"},
      {with(good, "archive/byteorder", "big"), absl::StatusCode::kInvalidArgument, "big-endian"},
      {with(good, "archive/byteorder", "middle"), absl::StatusCode::kDataLoss, "byteorder entry"},
      {no_storage, absl::StatusCode::kDataLoss,
       "refers to storage 0 but the archive has no entry archive/data/0"},
      {with(good, "archive/data/0", std::string(23, '\0')), absl::StatusCode::kDataLoss,
       "storage archive/data/0 holds 23 bytes, its pickle says 6 elements of Float (24 bytes)"},
      {with(good, "archive/data/1", std::string(3, '\x02')), absl::StatusCode::kDataLoss,
       "bool storage archive/data/1 holds a byte other than 0 or 1"},
      {with(good, "other/data.pkl", "\x80\x02N."), absl::StatusCode::kDataLoss,
       "holds two pickles"},
  };
  for (const Case& c : cases) {
    const absl::Status s = read_entries(c.entries);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
    EXPECT_THAT(std::string(s.message()), HasSubstr("file x.pt"));
  }
}

TEST(TorchFileReaderTest, DamagedLegacyAndForeignFiles) {
  std::string bytes = testing::make_zip(sample_entries());
  const absl::StatusOr<StoredZip> zip = read_stored_zip(bytes, "f");
  ASSERT_TRUE(zip.ok());
  bytes[static_cast<size_t>(zip->entries[2].data.data() - bytes.data()) + 5] ^=
      0x10;  // in archive/data/0
  ASSERT_EQ(zip->entries[2].name, "archive/data/0");
  absl::Status crc = read_torch_file(bytes, "file x.pt").status();
  EXPECT_EQ(crc.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(crc.message()),
              HasSubstr("file x.pt is damaged: entry archive/data/0 fails its CRC-32"));
  EXPECT_THAT(std::string(crc.message()), HasSubstr("load another copy, or save it again"));

  const std::string legacy("\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.\x80\x02", 17);
  absl::Status old = read_torch_file(legacy, "file old.pt").status();
  EXPECT_EQ(old.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(old.message()), HasSubstr("_use_new_zipfile_serialization=True"));

  absl::Status text = read_torch_file("just some text, no zip at all", "file t.txt").status();
  EXPECT_EQ(text.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(text.message()), HasSubstr("file t.txt is not a PyTorch file"));

  const std::string whole = testing::make_zip(sample_entries());
  EXPECT_EQ(read_torch_file(whole.substr(0, whole.size() / 2), "f").status().code(),
            absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace dtrain::checkpoint
