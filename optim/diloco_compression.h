// The codecs of DiLoCo's compressed outer gradients (DiLoCoOptions::outer_compression, whose
// comment in optim/diloco.h is the full contract), and the compressed average DiLoCo's sync runs:
// each rank encodes its flat float32 pseudo-gradient into bytes, the ranks all-gather the bytes,
// and every rank decodes every rank's bytes and averages them in rank order.
//
//   at::Tensor bytes = dtrain::optim::encode_outer(flat, "4bit");        // uint8, 1-D
//   at::Tensor back = dtrain::optim::decode_outer(bytes, flat.numel(), "4bit");  // float32
//   at::Tensor avg = dtrain::optim::compressed_average(group, flat, "4bit");   // collective
//   auto pending = dtrain::optim::start_compressed_average(group, flat, "4bit");  // not waited
//   at::Tensor later = dtrain::optim::finish_compressed_average(pending);  // waits, decodes
//
// Thread safety: the functions are pure (compressed_average is a collective over its group).
#ifndef DTRAIN_OPTIM_DILOCO_COMPRESSION_H_
#define DTRAIN_OPTIM_DILOCO_COMPRESSION_H_

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "comm/process_group.h"

namespace dtrain::optim {

// Elements per block of the "fp8_e4m3" and "4bit" codecs (one float32 absmax per block).
constexpr int64_t kOuterCompressionBlock = 64;

// TORCH_CHECKs that `mode` is one of "none", "bfloat16", "fp8_e4m3", "4bit", naming them if not.
void check_outer_compression(const std::string& mode);

// Bytes encode_outer produces for `numel` elements, which is what a rank sends to each other rank:
//   "none" 4*numel; "bfloat16" 2*numel; "fp8_e4m3" 4*B + numel; "4bit" 4*B + ceil(numel/2),
// with B = ceil(numel / kOuterCompressionBlock). REQUIRES: a valid mode, numel >= 0.
int64_t outer_compressed_bytes(const std::string& mode, int64_t numel);

// `flat` (1-D, float32, finite; any device) encoded as a 1-D uint8 tensor of
// outer_compressed_bytes(mode, numel) bytes: for "fp8_e4m3" and "4bit" the B float32 absmaxes
// first, then the codes. Non-finite values give unspecified results. REQUIRES: a valid mode.
at::Tensor encode_outer(const at::Tensor& flat, const std::string& mode);

// The float32 values (1-D, `numel` of them, on bytes' device) that encode_outer's `bytes` stand
// for. REQUIRES: bytes came from encode_outer(x, mode) with x.numel() == numel.
at::Tensor decode_outer(const at::Tensor& bytes, int64_t numel, const std::string& mode);

// The mean over the group's ranks of decode_outer(encode_outer(flat_r)), summed in rank order and
// then divided by the group's size, identical bits on every rank. One all-gather of each rank's
// encoded bytes (none for a group of one). Collective over `group`; every rank passes the same
// mode and numel. REQUIRES: mode != "none" (DiLoCo all-reduces float32 then), group.is_member().
at::Tensor compressed_average(const comm::Group& group, const at::Tensor& flat,
                              const std::string& mode);

// compressed_average in two halves, for an average that runs while the caller works on (DiLoCo's
// fragment_sync_delay): start_compressed_average encodes `flat` and issues the all-gather without
// waiting; finish_compressed_average waits for it and decodes. compressed_average(g, x, m) is
// finish_compressed_average(start_compressed_average(g, x, m)): the same codec path, the same bits.
// start is the collective (same contract as compressed_average); finish is local and REQUIRES a
// pending average that start returned and no finish consumed yet.
struct PendingCompressedAverage {
  c10::intrusive_ptr<c10d::Work> work;            // the all-gather; null for a group of one
  std::vector<std::vector<at::Tensor>> gathered;  // every rank's bytes, by rank, once it is done
  int64_t numel = 0;
  std::string mode;
};
PendingCompressedAverage start_compressed_average(const comm::Group& group, const at::Tensor& flat,
                                                  const std::string& mode);
at::Tensor finish_compressed_average(PendingCompressedAverage& pending);

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_DILOCO_COMPRESSION_H_
