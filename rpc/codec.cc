#include "rpc/codec.h"

#include <cstring>

namespace dtrain::rpc {
namespace {

constexpr char kMagic[4] = {'D', 'T', 'R', 'P'};
constexpr size_t kMaxName = 256;

std::string at(size_t pos) { return " at byte " + std::to_string(pos); }

}  // namespace

void Writer::raw(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  bytes_.insert(bytes_.end(), c, c + n);
}

Writer& Writer::i64(int64_t v) {
  bytes_.push_back(Reader::kI64);
  raw(&v, sizeof(v));
  return *this;
}

Writer& Writer::f64(double v) {
  bytes_.push_back(Reader::kF64);
  raw(&v, sizeof(v));
  return *this;
}

Writer& Writer::boolean(bool v) {
  bytes_.push_back(Reader::kBool);
  bytes_.push_back(v ? 1 : 0);
  return *this;
}

Writer& Writer::str(const std::string& v) {
  bytes_.push_back(Reader::kStr);
  const uint32_t n = static_cast<uint32_t>(v.size());
  raw(&n, sizeof(n));
  raw(v.data(), v.size());
  return *this;
}

Writer& Writer::i64_list(const std::vector<int64_t>& v) {
  bytes_.push_back(Reader::kI64List);
  const uint32_t n = static_cast<uint32_t>(v.size());
  raw(&n, sizeof(n));
  raw(v.data(), v.size() * sizeof(int64_t));
  return *this;
}

Writer& Writer::f64_list(const std::vector<double>& v) {
  bytes_.push_back(Reader::kF64List);
  const uint32_t n = static_cast<uint32_t>(v.size());
  raw(&n, sizeof(n));
  raw(v.data(), v.size() * sizeof(double));
  return *this;
}

void Reader::take(void* out, size_t n, const char* what) {
  if (bytes_.size() - pos_ < n) {
    throw CodecError("truncated message: " + std::string(what) + " needs " + std::to_string(n) +
                     " bytes" + at(pos_) + " but only " + std::to_string(bytes_.size() - pos_) +
                     " remain");
  }
  if (n == 0) return;  // an empty list's data() may be null: memcpy(nullptr, ..., 0) is undefined
  std::memcpy(out, bytes_.data() + pos_, n);
  pos_ += n;
}

uint8_t Reader::peek_tag() const {
  if (pos_ >= bytes_.size()) throw CodecError("message ends where a value was expected" + at(pos_));
  return static_cast<uint8_t>(bytes_[pos_]);
}

void Reader::expect(uint8_t tag, const char* what) {
  const uint8_t got = peek_tag();
  if (got != tag) {
    throw CodecError("expected " + std::string(what) + " (tag " + std::to_string(tag) +
                     ") but found tag " + std::to_string(got) + at(pos_));
  }
  ++pos_;
}

uint32_t Reader::count(size_t element_size, const char* what) {
  uint32_t n = 0;
  take(&n, sizeof(n), what);
  // A declared length must fit in what is left: no allocation on a lie.
  if (static_cast<uint64_t>(n) * element_size > bytes_.size() - pos_) {
    throw CodecError(std::string(what) + " declares " + std::to_string(n) + " elements (" +
                     std::to_string(static_cast<uint64_t>(n) * element_size) + " bytes) but only " +
                     std::to_string(bytes_.size() - pos_) + " bytes remain" + at(pos_));
  }
  return n;
}

int64_t Reader::i64() {
  expect(kI64, "an integer");
  int64_t v = 0;
  take(&v, sizeof(v), "an integer");
  return v;
}

double Reader::f64() {
  expect(kF64, "a double");
  double v = 0;
  take(&v, sizeof(v), "a double");
  return v;
}

bool Reader::boolean() {
  expect(kBool, "a boolean");
  uint8_t v = 0;
  take(&v, 1, "a boolean");
  if (v > 1) throw CodecError("boolean with value " + std::to_string(v) + at(pos_ - 1));
  return v == 1;
}

std::string Reader::str() {
  expect(kStr, "a string");
  const uint32_t n = count(1, "a string");
  std::string s(bytes_.data() + pos_, n);
  pos_ += n;
  return s;
}

std::vector<int64_t> Reader::i64_list() {
  expect(kI64List, "an integer list");
  const uint32_t n = count(sizeof(int64_t), "an integer list");
  std::vector<int64_t> v(n);
  take(v.data(), n * sizeof(int64_t), "an integer list");
  return v;
}

std::vector<double> Reader::f64_list() {
  expect(kF64List, "a double list");
  const uint32_t n = count(sizeof(double), "a double list");
  std::vector<double> v(n);
  take(v.data(), n * sizeof(double), "a double list");
  return v;
}

void Reader::expect_done() const {
  if (!done())
    throw CodecError(std::to_string(bytes_.size() - pos_) + " unexpected trailing bytes" +
                     at(pos_));
}

std::vector<char> encode_envelope(const std::string& handler, const Writer& body,
                                  size_t num_tensors, const std::string& caller) {
  std::vector<char> out(kMagic, kMagic + 4);
  out.push_back(static_cast<char>(kWireVersion));
  const char* p = nullptr;
  for (const std::string* name : {&handler, &caller}) {
    const uint16_t name_len = static_cast<uint16_t>(name->size());
    p = reinterpret_cast<const char*>(&name_len);
    out.insert(out.end(), p, p + sizeof(name_len));
    out.insert(out.end(), name->begin(), name->end());
  }
  const uint32_t tensors = static_cast<uint32_t>(num_tensors);
  p = reinterpret_cast<const char*>(&tensors);
  out.insert(out.end(), p, p + sizeof(tensors));
  const uint32_t body_len = static_cast<uint32_t>(body.bytes().size());
  p = reinterpret_cast<const char*>(&body_len);
  out.insert(out.end(), p, p + sizeof(body_len));
  out.insert(out.end(), body.bytes().begin(), body.bytes().end());
  return out;
}

Envelope decode_envelope(const std::vector<char>& bytes, size_t num_tensors) {
  size_t pos = 0;
  auto need = [&](size_t n, const char* what) {
    if (bytes.size() - pos < n) {
      throw CodecError("truncated message: " + std::string(what) + " needs " + std::to_string(n) +
                       " bytes" + at(pos) + " of " + std::to_string(bytes.size()));
    }
  };
  need(5, "the header");
  if (std::memcmp(bytes.data(), kMagic, 4) != 0)
    throw CodecError("not a dtrain RPC message (bad magic)");
  const uint8_t version = static_cast<uint8_t>(bytes[4]);
  if (version != kWireVersion) {
    throw CodecError("unsupported message version " + std::to_string(version) +
                     " (this build speaks " + std::to_string(kWireVersion) +
                     "); run the same dtrain version on every worker");
  }
  pos = 5;
  uint16_t name_len = 0;
  need(sizeof(name_len), "the handler name length");
  std::memcpy(&name_len, bytes.data() + pos, sizeof(name_len));
  pos += sizeof(name_len);
  if (name_len == 0 || name_len > kMaxName) {
    throw CodecError("handler name of " + std::to_string(name_len) + " bytes (1.." +
                     std::to_string(kMaxName) + " allowed)");
  }
  need(name_len, "the handler name");
  Envelope e;
  e.handler.assign(bytes.data() + pos, name_len);
  pos += name_len;
  uint16_t caller_len = 0;
  need(sizeof(caller_len), "the caller name length");
  std::memcpy(&caller_len, bytes.data() + pos, sizeof(caller_len));
  pos += sizeof(caller_len);
  if (caller_len > kMaxName) {
    throw CodecError("caller name of " + std::to_string(caller_len) + " bytes (0.." +
                     std::to_string(kMaxName) + " allowed)");
  }
  need(caller_len, "the caller name");
  e.caller.assign(bytes.data() + pos, caller_len);
  pos += caller_len;
  uint32_t tensors = 0, body_len = 0;
  need(sizeof(tensors), "the tensor count");
  std::memcpy(&tensors, bytes.data() + pos, sizeof(tensors));
  pos += sizeof(tensors);
  if (tensors != num_tensors) {
    throw CodecError("message declares " + std::to_string(tensors) + " tensors but carries " +
                     std::to_string(num_tensors));
  }
  need(sizeof(body_len), "the body length");
  std::memcpy(&body_len, bytes.data() + pos, sizeof(body_len));
  pos += sizeof(body_len);
  if (body_len != bytes.size() - pos) {
    throw CodecError("body declares " + std::to_string(body_len) + " bytes but " +
                     std::to_string(bytes.size() - pos) + " follow");
  }
  e.body = Reader(std::vector<char>(bytes.begin() + static_cast<std::ptrdiff_t>(pos), bytes.end()));
  return e;
}

}  // namespace dtrain::rpc
