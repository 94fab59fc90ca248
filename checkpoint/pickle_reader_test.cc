#include "checkpoint/pickle_reader.h"

#include <map>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace dtrain::checkpoint {
namespace {

using ::testing::HasSubstr;
using namespace std::string_literals;

std::string unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

// Storages for persistent ids: key -> bytes.
std::map<std::string, std::string> g_storages;

absl::StatusOr<c10::IValue> read(const std::string& pickle) {
  return read_pickle(pickle, "file t.pt",
                     [](const std::string& key, at::ScalarType dtype,
                        int64_t numel) -> absl::StatusOr<at::Storage> {
                       auto it = g_storages.find(key);
                       if (it == g_storages.end()) return absl::DataLossError("no storage " + key);
                       at::Tensor b =
                           at::empty({static_cast<int64_t>(it->second.size())}, at::kByte);
                       std::memcpy(b.data_ptr(), it->second.data(), it->second.size());
                       return b.storage();
                     });
}

std::string message(const absl::StatusOr<c10::IValue>& v) {
  return std::string(v.status().message());
}

// Python 3.11: pickle.dumps(V, protocol=p) for
// V = {'a': [1, 2.5, True, None, 'xé中'], 'b': (1, (2,), ()), 3: {'n': -5, 'm': 70000, 'k': -2**31},
//      'big': 2**62, 'neg': -2**40, 'f': False, 'e': [], 1.5: 'float key', False: 'bool key'}
const std::map<int, std::string> kPythonPickles = {
    {1,
     "7d71002858010000006171015d7102284b014740040000000000004930310a4e580600000078c3a9e4b8ad7103655"
     "801000000627104"
     "284b01284b02747105297471064b037d71072858010000006e71084afbffffff58010000006d71094a70110100580"
     "10000006b710a4a"
     "00000080755803000000626967710b4c343631313638363031383432373338373930344c0a58030000006e6567710"
     "c4c2d3130393935"
     "31313632373737364c0a580100000066710d4930300a580100000065710e5d710f473ff8000000000000580900000"
     "0666c6f6174206b"
     "657971104930300a5808000000626f6f6c206b65797111752e"},
    {2,
     "80027d71002858010000006171015d7102284b01474004000000000000884e580600000078c3a9e4b8ad710365580"
     "10000006271044b"
     "014b02857105298771064b037d71072858010000006e71084afbffffff58010000006d71094a70110100580100000"
     "06b710a4a000000"
     "80755803000000626967710b8a08000000000000004058030000006e6567710c8a060000000000ff5801000000667"
     "10d895801000000"
     "65710e5d710f473ff80000000000005809000000666c6f6174206b65797110895808000000626f6f6c206b6579711"
     "1752e"},
    {4,
     "8004959b000000000000007d94288c0161945d94284b01474004000000000000884e8c0678c3a9e4b8ad94658c016"
     "2944b014b028594"
     "2987944b037d94288c016e944afbffffff8c016d944a701101008c016b944a00000080758c03626967948a0800000"
     "000000000408c03"
     "6e6567948a060000000000ff8c016694898c0165945d94473ff80000000000008c09666c6f6174206b657994898c0"
     "8626f6f6c206b65"
     "7994752e"},
};

TEST(PickleReaderTest, ReadsPythonPicklesOfEveryProtocol) {
  for (const auto& [protocol, hex] : kPythonPickles) {
    SCOPED_TRACE(absl::StrCat("protocol ", protocol));
    absl::StatusOr<c10::IValue> v = read(unhex(hex));
    ASSERT_TRUE(v.ok()) << v.status();
    ASSERT_TRUE(v->isGenericDict());
    c10::impl::GenericDict d = v->toGenericDict();
    EXPECT_EQ(d.keyType()->kind(), c10::TypeKind::AnyType);
    std::vector<std::string> keys;
    for (const auto& kv : d)
      keys.push_back(kv.key().isString() ? kv.key().toStringRef() : kv.key().tagKind());
    EXPECT_EQ(keys, (std::vector<std::string>{"a", "b", "Int", "big", "neg", "f", "e", "Double",
                                              "Bool"}));
    c10::impl::GenericList a = d.at("a").toList();
    EXPECT_EQ(a.elementType()->kind(), c10::TypeKind::AnyType);
    ASSERT_EQ(a.size(), 5u);
    EXPECT_EQ(a.get(0).toInt(), 1);
    EXPECT_EQ(a.get(1).toDouble(), 2.5);
    EXPECT_TRUE(a.get(2).isBool() && a.get(2).toBool());
    EXPECT_TRUE(a.get(3).isNone());
    EXPECT_EQ(a.get(4).toStringRef(), "x\xc3\xa9\xe4\xb8\xad");
    const std::vector<c10::IValue> b = d.at("b").toTupleRef().elements().vec();
    ASSERT_EQ(b.size(), 3u);
    EXPECT_EQ(b[1].toTupleRef().elements()[0].toInt(), 2);
    EXPECT_EQ(b[2].toTupleRef().elements().size(), 0u);
    c10::impl::GenericDict three = d.at(int64_t{3}).toGenericDict();
    EXPECT_EQ(three.at("n").toInt(), -5);
    EXPECT_EQ(three.at("m").toInt(), 70000);
    EXPECT_EQ(three.at("k").toInt(), -(int64_t{1} << 31));
    EXPECT_EQ(d.at("big").toInt(), int64_t{1} << 62);
    EXPECT_EQ(d.at("neg").toInt(), -(int64_t{1} << 40));
    EXPECT_FALSE(d.at("f").toBool());
    EXPECT_EQ(d.at("e").toList().size(), 0u);
    EXPECT_EQ(d.at(1.5).toStringRef(), "float key");
    EXPECT_EQ(d.at(false).toStringRef(), "bool key");
  }
}

TEST(PickleReaderTest, MemoSharesContainersAndOrderedDictKeepsOrder) {
  // l = [1]; pickle.dumps({'a': l, 'b': l}, protocol=2)
  absl::StatusOr<c10::IValue> shared =
      read(unhex("80027d71002858010000006171015d71024b016158010000006271036802752e"));
  ASSERT_TRUE(shared.ok()) << shared.status();
  const c10::IValue a = shared->toGenericDict().at("a"), b = shared->toGenericDict().at("b");
  EXPECT_EQ(a.internalToPointer(), b.internalToPointer());
  // OrderedDict([('z', 1), ('a', 2)]), protocols 2 and 4 (STACK_GLOBAL, MEMOIZE, FRAME)
  for (const char* hex : {"800263636f6c6c656374696f6e730a4f726465726564446963740a710029527101285801"
                          "0000007a71024b01580100"
                          "00006171034b02752e",
                          "80049530000000000000008c0b636f6c6c656374696f6e73948c0b4f7264657265644469"
                          "6374949394295294288c"
                          "017a944b018c0161944b02752e"}) {
    absl::StatusOr<c10::IValue> od = read(unhex(hex));
    ASSERT_TRUE(od.ok()) << od.status();
    std::vector<std::string> keys;
    for (const auto& kv : od->toGenericDict()) keys.push_back(kv.key().toStringRef());
    EXPECT_EQ(keys, (std::vector<std::string>{"z", "a"}));
  }
}

TEST(PickleReaderTest, DisallowedGlobalsAreNamedAndNeverRun) {
  // pickle.loads would call os.system('touch /tmp/x'): protocol 0 GLOBAL and protocol 4 STACK_GLOBAL
  for (const std::string& p : {"cos\nsystem\n(X\x0c\0\0\0touch /tmp/xtR."s,
                               "\x80\x04\x8c\x02os\x8c\x06system\x93\x8c\x01x\x85R."s}) {
    absl::StatusOr<c10::IValue> v = read(p);
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(message(v), HasSubstr("file t.pt: its pickle, at byte "));
    EXPECT_THAT(message(v),
                HasSubstr("refers to the Python global os.system, which dtrain does not load"));
    EXPECT_THAT(message(v), HasSubstr("weights_only=True"));
  }
  EXPECT_THAT(message(read("\x80\x02"
                           "cbuiltins\neval\n.")),
              HasSubstr("global builtins.eval"));
  EXPECT_THAT(message(read("\x80\x02"
                           "ctorch._utils\n_rebuild_qtensor\n.")),
              HasSubstr("torch._utils._rebuild_qtensor"));
}

TEST(PickleReaderTest, MalformedPicklesAreDataLossWithTheirOffset) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"\x80\x02\x00"s, "at byte 2: 0x00 is not a pickle opcode"},
      {"\x80\x02}", "at byte 3: the pickle ends without a STOP opcode"},
      {"\x80\x02s.", "SETITEM finds the stack empty"},
      {"\x80\x02]K\x01"
       "e.",
       "APPENDS finds no MARK"},
      {"\x80\x02h\x05.", "GET of memo entry 5, never stored"},
      {std::string("\x80\x02X\xff\xff\xff\xff", 7),
       "BINUNICODE needs 4294967295 bytes but only 0 remain"},
      {std::string("\x80\x02\x8b\xff\xff\xff\x7f", 7), "LONG needs 2147483647 bytes"},
      {std::string("\x80\x02\x95\xff\0\0\0\0\0\0\0", 11), "FRAME is longer than the bytes left"},
      {"\x80\x02X\x02\0\0\0\xc3(."s, "not valid UTF-8"},
      {"\x80\x02K\x01K\x02.", "STOP leaves 1 items"},
      {"\x80\x02N.N", "1 bytes follow the STOP opcode"},
      {"\x80\x02]q\x00h\x00"
       "a."s,
       "a container contains itself"},
      {"\x80\x02K\x01}q\x00"s, "ends without a STOP"},
      {"\x80\x02}(K\x01K\x02K\x01K\x03u."s, "a dict key occurs twice"},
  };
  for (const auto& [pickle, want] : cases) {
    absl::StatusOr<c10::IValue> v = read(pickle);
    EXPECT_EQ(v.status().code(), absl::StatusCode::kDataLoss) << want << ": " << v.status();
    EXPECT_THAT(message(v), HasSubstr(want));
    EXPECT_THAT(message(v), HasSubstr("file t.pt is damaged: its pickle, at byte "));
  }
}

// A small pickle calling an allowed function again and again on one large memoized list: linear
// work per call would add up to hours or all memory for a few MB of file; it is refused.
TEST(PickleReaderTest, RepeatedCallsOnALargeValueExhaustTheWorkBudget) {
  std::string p = "\x80\x02]q\x00("s;
  for (int i = 0; i < 1000; ++i) p += "K\x01";
  p += "ectorch.jit._pickle\nbuild_intlist\nq\x01";
  for (int i = 0; i < 5000; ++i)
    p += "h\x01h\x00\x85R0"s;  // build_intlist(the list), result dropped
  p += "N.";
  absl::StatusOr<c10::IValue> v = read(p);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDataLoss) << v.status();
  EXPECT_THAT(message(v), HasSubstr("far more than a pickle of its size needs"));
  // The same calls a few times are fine.
  std::string few = p.substr(0, p.find("h\x01h\x00"s)) + "00h\x01h\x00\x85R."s;
  EXPECT_TRUE(read(few).ok()) << read(few).status();
}

TEST(PickleReaderTest, UnsupportedContentIsInvalidArgument) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"\x80\x06N.", "pickle protocol 6 is newer than 5"},
      {"\x80\x04\x8f.", "opcode EMPTY_SET (sets are not read)"},
      {"\x80\x04\x92.", "NEWOBJ_EX (creates an object)"},
      {"S'x'\np0\n.", "opcode STRING (protocol 0 str)"},
      {"\x80\x02}]N\x85s.", "a dict key is a list"},
      {std::string("\x80\x02\x8a\x09\0\0\0\0\0\0\0\0\x01.", 14), "does not fit 64 bits"},
      {"\x80\x02]ctorch\nFloatStorage\na.", "holds the Python global torch.FloatStorage"},
  };
  for (const auto& [pickle, want] : cases) {
    absl::StatusOr<c10::IValue> v = read(pickle);
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << want << ": " << v.status();
    EXPECT_THAT(message(v), HasSubstr(want));
  }
}

TEST(PickleReaderTest, DeepNestingIsRefusedWithoutRecursingIntoIt) {
  // 100000 nested tuples (one byte each), then 100000 nested lists built bottom-up through the memo
  // (each list is appended to after it was nested, so no depth is known while reading).
  absl::StatusOr<c10::IValue> tuples = read("\x80\x02N" + std::string(100000, '\x85') + ".");
  EXPECT_THAT(message(tuples), HasSubstr("tuples nest deeper than 1000"));
  std::string lists = "\x80\x02";
  for (int i = 0; i < 100000; ++i)
    lists += "]r" + std::string(reinterpret_cast<const char*>(&i), 4) + "0";
  for (int i = 0; i + 1 < 100000; ++i) {
    const int j = i + 1;
    lists += "j" + std::string(reinterpret_cast<const char*>(&i), 4) + "j" +
             std::string(reinterpret_cast<const char*>(&j), 4) + "a0";
  }
  absl::StatusOr<c10::IValue> deep = read(lists + "j" + std::string(4, '\0') + ".");
  EXPECT_THAT(message(deep), HasSubstr("containers nest deeper than 1000 levels"));
  // The same chain unreachable from the result: the result reads, the chain is dismantled.
  absl::StatusOr<c10::IValue> unreachable = read(lists + "K\x07.");
  ASSERT_TRUE(unreachable.ok()) << unreachable.status();
  EXPECT_EQ(unreachable->toInt(), 7);
}

std::string tensor_pickle(const std::string& dtype_class, int64_t numel,
                          const std::string& offset_size_stride,
                          const std::string& requires_grad = "\x89") {
  return "\x80\x02"
         "ctorch._utils\n_rebuild_tensor_v2\n((X\x07\0\0\0storagectorch\n"s +
         dtype_class +
         "\nX\x01\0\0\0"
         "0X\x03\0\0\0cpuK"s +
         std::string(1, static_cast<char>(numel)) + "tQ" + offset_size_stride + requires_grad +
         "ccollections\nOrderedDict\n)RtR.";
}

TEST(PickleReaderTest, TensorsAreBoundsCheckedAgainstTheirStorage) {
  g_storages = {{"0", std::string(24, '\0')}};
  // offset 1, size (2, 2), stride (2, 1): reaches element 4 of 6 floats.
  absl::StatusOr<c10::IValue> t =
      read(tensor_pickle("FloatStorage", 6, "K\x01(K\x02K\x02t(K\x02K\x01t"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->toTensor().sizes(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(t->toTensor().storage_offset(), 1);
  EXPECT_THAT(message(read(tensor_pickle("FloatStorage", 6, "K\x03(K\x02K\x02t(K\x02K\x01t"))),
              HasSubstr("a tensor reaches element 6 of a storage of 6 elements"));
  EXPECT_THAT(message(read(tensor_pickle("FloatStorage", 6, "K\x00(K\x02t(J\xff\xff\xff\xfft"s))),
              HasSubstr("negative size or stride"));
  EXPECT_THAT(message(read(tensor_pickle("FloatStorage", 6, "K\x00(K\x02K\x02t(K\x01t"s))),
              HasSubstr("a tensor has 2 sizes but 1 strides"));
  EXPECT_THAT(message(read(tensor_pickle("FloatStorage", 6,
                                         "K\x00(\x8a\x08\0\0\0\0\0\0\0\x40K\x01t(K\x01K\x01t"s))),
              HasSubstr("a tensor reaches element"));
  EXPECT_THAT(message(read(tensor_pickle("LongStorage", 3, "K\x00(K\x03t(K\x01t"s, "\x88"))),
              HasSubstr("a tensor of dtype Long requires grad"));
  // Empty tensors may sit anywhere, as in PyTorch.
  EXPECT_TRUE(read(tensor_pickle("FloatStorage", 6, "K\x09(K\x00t(K\x01t"s)).ok());
  g_storages = {{"0", std::string(4, '\x02')}};
  EXPECT_TRUE(read(tensor_pickle("ByteStorage", 4, "K\x00(K\x04t(K\x01t"s)).ok());
}

TEST(PickleReaderTest, TypeTagsAndTypedLists) {
  // restore_type_tag({'a': 1}, 'Dict[str, int]') and build_intlist([1, 2])
  absl::StatusOr<c10::IValue> d = read(
      "\x80\x02"
      "ctorch.jit._pickle\nrestore_type_tag\n}X\x01\0\0\0aK\x01sX\x0e\0\0\0Dict[str, int]\x86R."s);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->type()->str(), "Dict(str, int)");
  absl::StatusOr<c10::IValue> mismatch = read(
      "\x80\x02"
      "ctorch.jit._pickle\nrestore_type_tag\n}X\x01\0\0\0aN"
      "sX\x0e\0\0\0Dict[str, int]\x86R."s);
  ASSERT_TRUE(mismatch.ok()) << mismatch.status();
  EXPECT_EQ(mismatch->type()->str(),
            "Dict(Any, Any)");  // a tag never claims what the dict does not hold
  absl::StatusOr<c10::IValue> l = read(
      "\x80\x02"
      "ctorch.jit._pickle\nbuild_intlist\n](K\x01K\x02"
      "e\x85R.");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(l->isIntList());
  EXPECT_EQ(l->toIntVector(), (std::vector<int64_t>{1, 2}));
  EXPECT_THAT(message(read("\x80\x02"
                           "ctorch.jit._pickle\nbuild_intlist\n](X\x01\0\0\0a"
                           "e\x85R."s)),
              HasSubstr("build_intlist of a list holding another type"));
  absl::StatusOr<c10::IValue> size = read(
      "\x80\x02"
      "ctorch\nSize\n(K\x02K\x03t\x85R.");
  ASSERT_TRUE(size.ok()) << size.status();
  EXPECT_EQ(size->toTupleRef().elements().size(), 2u);
}

}  // namespace
}  // namespace dtrain::checkpoint
