// Fuzz target: rpc/codec's envelope and body decoding. Every input must decode to values or throw
// CodecError; any other exception (bad_alloc from a lying length, length_error) escapes and aborts.
#include <string>
#include <vector>

#include "fuzz/fuzz_target.h"
#include "rpc/codec.h"

namespace dtrain::fuzz {

std::vector<std::string> seeds() {
  std::vector<std::string> out;
  auto add = [&](const std::string& handler, const rpc::Writer& w, size_t tensors) {
    const std::vector<char> bytes = rpc::encode_envelope(handler, w, tensors);
    // The first byte picks the tensor count the decoder is told (see below).
    out.push_back(std::string(1, static_cast<char>(tensors)) +
                  std::string(bytes.begin(), bytes.end()));
  };
  add("dtrain.optim.step", rpc::Writer().i64(42).str("Adam").f64_list({0.9, 0.999}).boolean(true),
      2);
  add("h", rpc::Writer(), 0);
  add("dtrain.remote.get", rpc::Writer().i64_list({1, -2, 3}).f64(1e-300).str(""), 1);
  add(std::string(256, 'x'), rpc::Writer().i64_list({}).f64_list({}).str(std::string(300, 'y')), 3);
  return out;
}

}  // namespace dtrain::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using dtrain::rpc::Reader;
  if (size == 0) return 0;
  const size_t tensors = data[0] % 4;
  const std::vector<char> bytes(reinterpret_cast<const char*>(data) + 1,
                                reinterpret_cast<const char*>(data) + size);
  try {
    dtrain::rpc::Envelope e = dtrain::rpc::decode_envelope(bytes, tensors);
    while (!e.body.done()) {
      switch (e.body.peek_tag()) {
        case Reader::kI64:
          e.body.i64();
          break;
        case Reader::kF64:
          e.body.f64();
          break;
        case Reader::kBool:
          e.body.boolean();
          break;
        case Reader::kStr:
          e.body.str();
          break;
        case Reader::kI64List:
          e.body.i64_list();
          break;
        case Reader::kF64List:
          e.body.f64_list();
          break;
        default:
          e.body.i64();
          break;  // an unknown tag: must be a CodecError
      }
    }
    e.body.expect_done();
  } catch (const dtrain::rpc::CodecError&) {
  }
  return 0;
}
