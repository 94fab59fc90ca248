#include "comm/object_collectives.h"

#include <cstring>
#include <exception>
#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/str_cat.h"
#include "comm/exception_status.h"

namespace dtrain::comm {
namespace {

// The collective's failure: a timeout says what keeps a peer from answering (callers that run
// heartbeats, such as examples:train, name the rank).
absl::Status transport_error(const char* op) {
  absl::Status s = current_exception_status(absl::StatusCode::kUnavailable, op);
  if (!absl::IsDeadlineExceeded(s)) return s;
  return absl::DeadlineExceededError(
      absl::StrCat(s.message(), " (a rank did not take part: it did not call ", op,
                   ", or it stopped, crashed or lost its link)"));
}

// The object's pickle as a byte tensor on `device` (the group's: NCCL refuses CPU tensors).
absl::StatusOr<at::Tensor> serialize(const c10::IValue& obj, c10::Device device, const char* op) {
  try {
    std::vector<char> bytes = torch::jit::pickle_save(obj);
    at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    return t.to(device);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(op, ": cannot serialize the object: ", e.what()));
  }
}

absl::StatusOr<c10::IValue> deserialize(const at::Tensor& device_bytes, int64_t size,
                                        const char* op) {
  try {
    const at::Tensor bytes = device_bytes.cpu();
    const char* p = static_cast<const char*>(bytes.data_ptr());
    return torch::jit::pickle_load(std::vector<char>(p, p + size));
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat(op, ": cannot deserialize a received object: ", e.what()));
  }
}

absl::Status check_root(const Group& group, int root, const char* what, const char* op) {
  if (!group.is_member()) {
    return absl::FailedPreconditionError(
        absl::StrCat(op, ": this rank is not a member of the group"));
  }
  if (root < 0 || root >= group.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", what, "=", root, " is not a rank of this group of ", group.size()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status broadcast_object(const Group& group, c10::IValue& obj, int src) {
  constexpr const char* op = "broadcast_object";
  if (absl::Status s = check_root(group, src, "src", op); !s.ok()) return s;
  const bool me = group.rank() == src;
  const c10::Device device = group.device();
  at::Tensor bytes;
  at::Tensor size = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(device));
  if (me) {
    auto t = serialize(obj, device, op);
    if (!t.ok()) return t.status();
    bytes = *std::move(t);
    size.fill_(bytes.numel());
  }
  try {
    c10d::BroadcastOptions bo;
    bo.rootRank = src;
    std::vector<at::Tensor> sv = {size};
    group->broadcast(sv, bo)->wait();
    if (!me)
      bytes =
          at::empty({size.item<int64_t>()}, at::TensorOptions().dtype(at::kByte).device(device));
    std::vector<at::Tensor> bv = {bytes};
    group->broadcast(bv, bo)->wait();
  } catch (...) {
    return transport_error(op);
  }
  if (!me) {
    auto v = deserialize(bytes, bytes.numel(), op);
    if (!v.ok()) return v.status();
    obj = *std::move(v);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<c10::IValue>> all_gather_object(const Group& group,
                                                           const c10::IValue& obj) {
  constexpr const char* op = "all_gather_object";
  if (absl::Status s = check_root(group, 0, "rank", op); !s.ok()) return s;
  const c10::Device device = group.device();
  const at::TensorOptions longs = at::TensorOptions().dtype(at::kLong).device(device);
  const at::TensorOptions bytes = at::TensorOptions().dtype(at::kByte).device(device);
  auto mine = serialize(obj, device, op);
  if (!mine.ok()) return mine.status();
  const int n = group.size();
  std::vector<at::Tensor> padded(n);
  at::Tensor sizes = at::empty({n}, longs);
  try {
    // Sizes first, then one all-gather of buffers padded to the largest.
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < n; ++r) out[0].push_back(sizes.narrow(0, r, 1));
    std::vector<at::Tensor> in = {at::full({1}, mine->numel(), longs)};
    group->allgather(out, in)->wait();
    const int64_t max_size = sizes.max().item<int64_t>();
    at::Tensor send = at::zeros({max_size}, bytes);
    send.narrow(0, 0, mine->numel()).copy_(*mine);
    std::vector<std::vector<at::Tensor>> recv(1);
    for (int r = 0; r < n; ++r) {
      padded[r] = at::empty({max_size}, bytes);
      recv[0].push_back(padded[r]);
    }
    std::vector<at::Tensor> sendv = {send};
    group->allgather(recv, sendv)->wait();
  } catch (...) {
    return transport_error(op);
  }
  std::vector<c10::IValue> objects;
  objects.reserve(n);
  const at::Tensor host_sizes = sizes.cpu();
  for (int r = 0; r < n; ++r) {
    auto v = deserialize(padded[r], host_sizes[r].item<int64_t>(), op);
    if (!v.ok()) return v.status();
    objects.push_back(*std::move(v));
  }
  return objects;
}

absl::StatusOr<std::vector<c10::IValue>> gather_object(const Group& group, const c10::IValue& obj,
                                                       int dst) {
  constexpr const char* op = "gather_object";
  if (absl::Status s = check_root(group, dst, "dst", op); !s.ok()) return s;
  const c10::Device device = group.device();
  const at::TensorOptions longs = at::TensorOptions().dtype(at::kLong).device(device);
  auto mine = serialize(obj, device, op);
  if (!mine.ok()) return mine.status();
  const int n = group.size();
  const bool me = group.rank() == dst;
  // Sizes go to dst only; then every other rank sends exactly its bytes to dst, point to point,
  // so no rank but dst ever holds another rank's object (no padding, no all-gather).
  at::Tensor sizes = at::empty({n}, longs);
  std::vector<at::Tensor> received(n);
  try {
    c10d::GatherOptions go;
    go.rootRank = dst;
    std::vector<at::Tensor> in = {at::full({1}, mine->numel(), longs)};
    std::vector<std::vector<at::Tensor>> out;
    if (me) {
      out.resize(1);
      for (int r = 0; r < n; ++r) out[0].push_back(sizes.narrow(0, r, 1));
    }
    group->gather(out, in, go)->wait();
    constexpr int kTag = 0x0b1ec7;
    if (me) {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      const at::Tensor host_sizes = sizes.cpu();
      for (int r = 0; r < n; ++r) {
        if (r == dst) continue;
        received[r] = at::empty({host_sizes[r].item<int64_t>()},
                                at::TensorOptions().dtype(at::kByte).device(device));
        std::vector<at::Tensor> rv = {received[r]};
        works.push_back(group->recv(rv, r, kTag));
      }
      for (auto& w : works) w->wait();
    } else {
      std::vector<at::Tensor> sv = {*mine};
      group->send(sv, dst, kTag)->wait();
    }
  } catch (...) {
    return transport_error(op);
  }
  if (!me) return std::vector<c10::IValue>{};
  std::vector<c10::IValue> objects(n);
  for (int r = 0; r < n; ++r) {
    // dst's own entry also goes through the pickler, so no entry aliases the caller's tensors.
    const at::Tensor& bytes = r == dst ? *mine : received[r];
    auto v = deserialize(bytes, bytes.numel(), op);
    if (!v.ok()) return v.status();
    objects[r] = *std::move(v);
  }
  return objects;
}

}  // namespace dtrain::comm
