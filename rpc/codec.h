// The RPC wire format: a typed, versioned envelope and body that are checked before use. No code
// and no pickled objects travel: a message is a handler name, the sending worker's name, a
// sequence of tagged values (integers, doubles, booleans, strings, lists of them) and tensors
// (carried by TensorPipe). dtrain's own messages are in rpc/internal/protocol.h.
//
//   dtrain::rpc::Writer w;
//   w.i64(context_id).str("Adam").f64_list({0.9, 0.999});
//   std::vector<char> bytes = encode_envelope("my.handler", w, /*num_tensors=*/2, "trainer0");
//   ...
//   Envelope e = decode_envelope(bytes, tensors.size());   // throws CodecError on any defect
//   int64_t id = e.body.i64();                             // throws CodecError on a type mismatch
//
// Every read checks the tag, the declared length against the bytes left, and element counts
// against sane bounds, so a truncated, corrupt or hostile message is an error, never an
// out-of-bounds read or a huge allocation.
#ifndef DTRAIN_RPC_CODEC_H_
#define DTRAIN_RPC_CODEC_H_

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtrain::rpc {

constexpr uint8_t kWireVersion = 2;  // 2: the caller's name after the handler's

// A malformed message; the text says what was wrong and where.
class CodecError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Writer {
 public:
  Writer& i64(int64_t v);
  Writer& f64(double v);
  Writer& boolean(bool v);
  Writer& str(const std::string& v);
  Writer& i64_list(const std::vector<int64_t>& v);
  Writer& f64_list(const std::vector<double>& v);
  const std::vector<char>& bytes() const { return bytes_; }

 private:
  void raw(const void* p, size_t n);
  std::vector<char> bytes_;
};

class Reader {
 public:
  Reader() = default;
  explicit Reader(std::vector<char> bytes) : bytes_(std::move(bytes)) {}
  int64_t i64();
  double f64();
  bool boolean();
  std::string str();
  std::vector<int64_t> i64_list();
  std::vector<double> f64_list();
  // The tag of the next value (CodecError at the end).
  uint8_t peek_tag() const;
  bool done() const { return pos_ == bytes_.size(); }
  // CodecError unless every byte was read (trailing garbage is a defect too).
  void expect_done() const;

  enum Tag : uint8_t { kI64 = 1, kF64 = 2, kBool = 3, kStr = 4, kI64List = 5, kF64List = 6 };

 private:
  void expect(uint8_t tag, const char* what);
  void take(void* out, size_t n, const char* what);
  uint32_t count(size_t element_size, const char* what);
  std::vector<char> bytes_;
  size_t pos_ = 0;
};

struct Envelope {
  std::string handler;
  std::string caller;  // the sending worker's name as it states it (empty: not stated)
  Reader body;
};

// "DTRP", version, handler name, caller name, body, and the number of tensors that travel beside it.
std::vector<char> encode_envelope(const std::string& handler, const Writer& body,
                                  size_t num_tensors, const std::string& caller = "");
// Checks magic, version, every length and the tensor count. Handler names are 1..256 bytes,
// caller names 0..256.
Envelope decode_envelope(const std::vector<char>& bytes, size_t num_tensors);

}  // namespace dtrain::rpc

#endif  // DTRAIN_RPC_CODEC_H_
