#include "optim/diloco_compression.h"

#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace dtrain::optim {
namespace {

constexpr int64_t kBlock = kOuterCompressionBlock;

int64_t num_blocks(int64_t numel) { return (numel + kBlock - 1) / kBlock; }

bool blockwise(const std::string& mode) { return mode == "fp8_e4m3" || mode == "4bit"; }

// The largest code of a blockwise mode: a block's absmax maps to it.
float max_code(const std::string& mode) { return mode == "4bit" ? 7.0F : 448.0F; }

// flat padded with zeros to whole blocks, as [B, kBlock].
at::Tensor blocks_of(const at::Tensor& flat) {
  const int64_t n = flat.numel(), padded = num_blocks(n) * kBlock;
  at::Tensor x = flat.reshape(-1);
  if (padded != n) x = at::cat({x, at::zeros({padded - n}, x.options())});
  return x.view({-1, kBlock});
}

// Each block's step (absmax / max code, a division by a tensor so that no device replaces it
// with a multiplication by the reciprocal), as [B, 1].
at::Tensor steps_of(const at::Tensor& absmax, const std::string& mode) {
  return at::div(absmax, at::full_like(absmax, max_code(mode))).unsqueeze(1);
}

// Two 4-bit two's complement codes per byte, element 2i in the low nibble; `q` holds integers in
// [-7, 7] (any dtype); an odd count leaves the last high nibble 0.
at::Tensor pack_nibbles(const at::Tensor& q, int64_t numel) {
  at::Tensor nib = at::remainder(q.reshape(-1).to(at::kInt), 16);  // -7 -> 9
  const at::Tensor pairs = nib.view({-1, 2});
  const at::Tensor bytes = (pairs.select(1, 0) + pairs.select(1, 1) * 16).to(at::kByte);
  return bytes.narrow(0, 0, (numel + 1) / 2);
}

// The codes of pack_nibbles as float32, padded with zeros to whole blocks, as [B, kBlock].
at::Tensor unpack_nibbles(const at::Tensor& bytes, int64_t numel) {
  const at::Tensor v = bytes.to(at::kInt);
  const at::Tensor nib = at::stack({at::remainder(v, 16), at::div(v, 16, "floor")}, 1).view(-1);
  at::Tensor q = at::where(nib >= 8, nib - 16, nib).to(at::kFloat);
  const int64_t padded = num_blocks(numel) * kBlock;
  if (q.numel() != padded) q = at::cat({q, at::zeros({padded - q.numel()}, q.options())});
  return q.view({-1, kBlock});
}

}  // namespace

void check_outer_compression(const std::string& mode) {
  TORCH_CHECK(mode == "none" || mode == "bfloat16" || blockwise(mode),
              "DiLoCoOptions::outer_compression is '", mode,
              "'; use one of \"none\" (float32, exact), \"bfloat16\", \"fp8_e4m3\", \"4bit\"");
}

int64_t outer_compressed_bytes(const std::string& mode, int64_t numel) {
  check_outer_compression(mode);
  if (mode == "none") return 4 * numel;
  if (mode == "bfloat16") return 2 * numel;
  const int64_t scales = 4 * num_blocks(numel);
  return mode == "fp8_e4m3" ? scales + numel : scales + (numel + 1) / 2;
}

at::Tensor encode_outer(const at::Tensor& flat, const std::string& mode) {
  check_outer_compression(mode);
  TORCH_CHECK(flat.scalar_type() == at::kFloat, "encode_outer: the values are ", flat.scalar_type(),
              "; pass float32");
  const int64_t n = flat.numel();
  if (mode == "none") return flat.reshape(-1).contiguous().view(at::kByte);
  if (mode == "bfloat16") return flat.reshape(-1).to(at::kBFloat16).contiguous().view(at::kByte);
  const at::Tensor blocks = blocks_of(flat);
  const at::Tensor absmax = blocks.abs().amax(1).contiguous();
  const at::Tensor step = steps_of(absmax, mode);
  const at::Tensor scaled = blocks / at::where(step > 0, step, at::ones_like(step));
  const double top = max_code(mode);
  at::Tensor codes;
  if (mode == "4bit") {
    codes = pack_nibbles(at::round(scaled).clamp(-top, top), n);
  } else {
    codes = scaled.clamp(-top, top).to(at::kFloat8_e4m3fn).reshape(-1).narrow(0, 0, n);
    codes = codes.contiguous().view(at::kByte);
  }
  return at::cat({absmax.view(at::kByte), codes});
}

at::Tensor decode_outer(const at::Tensor& bytes, int64_t numel, const std::string& mode) {
  TORCH_CHECK(bytes.scalar_type() == at::kByte && bytes.dim() == 1 &&
                  bytes.numel() == outer_compressed_bytes(mode, numel),
              "decode_outer: expected ", outer_compressed_bytes(mode, numel),
              " bytes (uint8, 1-D) for ", numel, " elements in mode '", mode, "', got ",
              bytes.numel());
  const at::Tensor b = bytes.contiguous();
  if (mode == "none") return b.view(at::kFloat).clone();
  if (mode == "bfloat16") return b.view(at::kBFloat16).to(at::kFloat);
  const int64_t nb = num_blocks(numel);
  const at::Tensor absmax = b.narrow(0, 0, 4 * nb).clone().view(at::kFloat);
  const at::Tensor codes = b.narrow(0, 4 * nb, b.numel() - 4 * nb);
  at::Tensor q;
  if (mode == "4bit") {
    q = unpack_nibbles(codes, numel);
  } else {
    q = codes.clone().view(at::kFloat8_e4m3fn).to(at::kFloat);
    q = at::cat({q, at::zeros({nb * kBlock - numel}, q.options())}).view({-1, kBlock});
  }
  return (q * steps_of(absmax, mode)).reshape(-1).narrow(0, 0, numel).contiguous();
}

PendingCompressedAverage start_compressed_average(const comm::Group& group, const at::Tensor& flat,
                                                  const std::string& mode) {
  TORCH_CHECK(mode != "none", "compressed_average: mode 'none' is DiLoCo's float32 all-reduce");
  PendingCompressedAverage pending;
  pending.numel = flat.numel();
  pending.mode = mode;
  std::vector<at::Tensor> mine = {encode_outer(flat, mode)};
  pending.gathered.resize(1);
  if (group.size() == 1) {
    pending.gathered[0] = mine;
  } else {
    for (int r = 0; r < group.size(); ++r) pending.gathered[0].push_back(at::empty_like(mine[0]));
    pending.work = group->allgather(pending.gathered, mine);
  }
  return pending;
}

at::Tensor finish_compressed_average(PendingCompressedAverage& pending) {
  TORCH_CHECK(pending.gathered.size() == 1 && !pending.gathered[0].empty(),
              "finish_compressed_average: nothing is pending (finished already, or not from "
              "start_compressed_average); call it once per start_compressed_average");
  if (pending.work) pending.work->wait();
  pending.work.reset();
  const std::vector<at::Tensor> all = std::move(pending.gathered[0]);
  pending.gathered.clear();
  at::Tensor sum = decode_outer(all[0], pending.numel, pending.mode);
  for (size_t r = 1; r < all.size(); ++r)
    sum.add_(decode_outer(all[r], pending.numel, pending.mode));
  return sum.div_(static_cast<int64_t>(all.size()));
}

at::Tensor compressed_average(const comm::Group& group, const at::Tensor& flat,
                              const std::string& mode) {
  PendingCompressedAverage pending = start_compressed_average(group, flat, mode);
  return finish_compressed_average(pending);
}

}  // namespace dtrain::optim
