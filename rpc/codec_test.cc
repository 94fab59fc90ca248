#include "rpc/codec.h"

#include <cstring>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace dtrain::rpc {
namespace {

using ::testing::HasSubstr;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const CodecError& e) {
    return e.what();
  }
  return "no error";
}

TEST(CodecTest, RoundTripsEveryType) {
  Writer w;
  w.i64(-7).f64(2.5).boolean(true).str("Adam").i64_list({1, 2, 3}).f64_list({0.9, 0.999});
  Envelope e = decode_envelope(encode_envelope("dtrain.x", w, 2), 2);
  EXPECT_EQ(e.handler, "dtrain.x");
  EXPECT_EQ(e.body.i64(), -7);
  EXPECT_EQ(e.body.f64(), 2.5);
  EXPECT_TRUE(e.body.boolean());
  EXPECT_EQ(e.body.str(), "Adam");
  EXPECT_EQ(e.body.i64_list(), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(e.body.f64_list(), (std::vector<double>{0.9, 0.999}));
  EXPECT_TRUE(e.body.done());
}

TEST(CodecTest, CarriesTheCallersName) {
  Writer w;
  w.i64(5);
  Envelope e = decode_envelope(encode_envelope("h", w, 0, "trainer3"), 0);
  EXPECT_EQ(e.handler, "h");
  EXPECT_EQ(e.caller, "trainer3");
  EXPECT_EQ(e.body.i64(), 5);
  EXPECT_EQ(decode_envelope(encode_envelope("h", w, 0), 0).caller, "");
  EXPECT_THAT(
      error_of([&] { decode_envelope(encode_envelope("h", w, 0, std::string(257, 'c')), 0); }),
      HasSubstr("caller name of 257 bytes"));
}

// Empty strings and lists: nothing is copied from or to a null data() (undefined behaviour that
// --config=asan's UBSan reports).
TEST(CodecTest, RoundTripsEmptyValues) {
  Writer w;
  w.str("").i64_list({}).f64_list({}).i64(3);
  Envelope e = decode_envelope(encode_envelope("h", w, 0), 0);
  EXPECT_EQ(e.body.str(), "");
  EXPECT_TRUE(e.body.i64_list().empty());
  EXPECT_TRUE(e.body.f64_list().empty());
  EXPECT_EQ(e.body.i64(), 3);
  EXPECT_TRUE(e.body.done());
}

TEST(CodecTest, EveryTruncationIsAnErrorNotACrash) {
  Writer w;
  w.i64(1).str("hello").i64_list({4, 5}).f64_list({1.0});
  const std::vector<char> full = encode_envelope("h", w, 0);
  for (size_t n = 0; n < full.size(); ++n) {
    std::vector<char> cut(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_NE(error_of([&] { decode_envelope(cut, 0); }), "no error") << "length " << n;
  }
}

TEST(CodecTest, BodyTruncationInsideAValueIsNamed) {
  Writer w;
  w.str("hello");
  std::vector<char> bytes = w.bytes();
  bytes.pop_back();
  Reader r(bytes);
  EXPECT_THAT(error_of([&] { r.str(); }),
              HasSubstr("a string declares 5 elements (5 bytes) but only 4 bytes remain"));
}

TEST(CodecTest, HugeDeclaredLengthsAllocateNothing) {
  Writer w;
  w.i64_list({1});
  std::vector<char> bytes = w.bytes();
  const uint32_t huge = 0xFFFFFFFFu;
  std::memcpy(bytes.data() + 1, &huge, sizeof(huge));
  Reader r(bytes);
  EXPECT_THAT(error_of([&] { r.i64_list(); }), HasSubstr("declares 4294967295 elements"));
}

TEST(CodecTest, EnvelopeDefects) {
  Writer w;
  w.i64(1);
  std::vector<char> good = encode_envelope("h", w, 1);
  EXPECT_THAT(error_of([&] { decode_envelope(good, 2); }),
              HasSubstr("declares 1 tensors but carries 2"));
  std::vector<char> bad_magic = good;
  bad_magic[0] = 'X';
  EXPECT_THAT(error_of([&] { decode_envelope(bad_magic, 1); }), HasSubstr("bad magic"));
  std::vector<char> new_version = good;
  new_version[4] = 9;
  EXPECT_THAT(error_of([&] { decode_envelope(new_version, 1); }),
              HasSubstr("unsupported message version 9"));
  std::vector<char> trailing = good;
  trailing.push_back(0);
  EXPECT_THAT(error_of([&] { decode_envelope(trailing, 1); }),
              HasSubstr("body declares 9 bytes but 10 follow"));
  EXPECT_THAT(error_of([&] { decode_envelope(encode_envelope("", w, 0), 0); }),
              HasSubstr("handler name of 0 bytes"));
}

TEST(CodecTest, TypeMismatchAndTrailingValues) {
  Writer w;
  w.f64(1.0).i64(3);
  Reader r(w.bytes());
  EXPECT_THAT(error_of([&] { r.i64(); }),
              HasSubstr("expected an integer (tag 1) but found tag 2 at byte 0"));
  Reader r2(w.bytes());
  r2.f64();
  EXPECT_THAT(error_of([&] { r2.expect_done(); }), HasSubstr("9 unexpected trailing bytes"));
  Writer b;
  b.boolean(true);
  std::vector<char> bytes = b.bytes();
  bytes[1] = 7;
  Reader r3(bytes);
  EXPECT_THAT(error_of([&] { r3.boolean(); }), HasSubstr("boolean with value 7"));
}

}  // namespace
}  // namespace dtrain::rpc
