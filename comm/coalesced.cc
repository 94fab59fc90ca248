#include "comm/coalesced.h"

#include <map>
#include <utility>

namespace dtrain::comm {
namespace {

void check_dense(at::TensorList tensors, const char* op) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].defined(), op, ": tensor ", i, " is undefined");
    TORCH_CHECK(tensors[i].layout() == at::kStrided, op, ": tensor ", i, " is not dense (layout ",
                tensors[i].layout(), "); coalesce sparse tensors separately");
    TORCH_CHECK(tensors[i].device() == tensors[0].device(), op, ": tensor ", i, " is on ",
                tensors[i].device(), " but tensor 0 is on ", tensors[0].device());
  }
}

std::vector<at::Tensor> pick(const std::vector<at::Tensor>& tensors,
                             const std::vector<size_t>& idx) {
  std::vector<at::Tensor> out;
  out.reserve(idx.size());
  for (size_t i : idx) out.push_back(tensors[i]);
  return out;
}

int64_t total_numel(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  return n;
}

// Copies the flat buffer back into the tensors, skipping those that already are its views.
void copy_back(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> views = ::dtrain::comm::unflatten_dense_tensors(flat, tensors);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].is_same(views[i])) tensors[i].copy_(views[i]);
  }
}

}  // namespace

at::Tensor flatten_dense_tensors(at::TensorList tensors) {
  check_dense(tensors, "flatten_dense_tensors");
  if (tensors.empty()) return at::empty({0});
  int64_t total = 0;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(),
                "flatten_dense_tensors: tensor of dtype ", t.scalar_type(), " mixed with ",
                tensors[0].scalar_type(), "; bucket by dtype first");
    total += t.numel();
  }
  at::Tensor flat = at::empty({total}, tensors[0].options());
  int64_t offset = 0;
  for (const auto& t : tensors) {
    flat.narrow(0, offset, t.numel()).view(t.sizes()).copy_(t);
    offset += t.numel();
  }
  return flat;
}

std::vector<at::Tensor> unflatten_dense_tensors(const at::Tensor& flat, at::TensorList like) {
  int64_t total = 0;
  for (const auto& t : like) total += t.numel();
  TORCH_CHECK(flat.dim() == 1 && flat.numel() == total, "unflatten_dense_tensors: flat buffer of ",
              flat.numel(), " elements for tensors totalling ", total);
  std::vector<at::Tensor> out;
  out.reserve(like.size());
  int64_t offset = 0;
  for (const auto& t : like) {
    out.push_back(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
  return out;
}

std::vector<std::vector<size_t>> bucket_tensors(at::TensorList tensors, int64_t cap_bytes) {
  TORCH_CHECK(cap_bytes > 0, "bucket cap must be positive, got ", cap_bytes, " bytes");
  std::vector<std::vector<size_t>> buckets;
  // dtype -> (index of its open bucket, bytes in it)
  std::map<at::ScalarType, std::pair<size_t, int64_t>> open;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t bytes = tensors[i].numel() * static_cast<int64_t>(tensors[i].element_size());
    auto it = open.find(tensors[i].scalar_type());
    if (it == open.end() || it->second.second + bytes > cap_bytes) {
      buckets.emplace_back();
      it = open.insert_or_assign(tensors[i].scalar_type(),
                                 std::make_pair(buckets.size() - 1, int64_t{0}))
               .first;
    }
    buckets[it->second.first].push_back(i);
    it->second.second += bytes;
  }
  return buckets;
}

CoalescedWork::~CoalescedWork() {
  // An unwaited work would leave the caller's tensors unspecified; finish it, never throw here.
  if (!waited_) {
    try {
      wait();
    } catch (...) {
    }
  }
}

void CoalescedWork::wait() {
  if (waited_) return;
  waited_ = true;
  for (auto& b : buckets_) {
    b.work->wait();
    if (b.finish) b.finish();
  }
}

bool CoalescedWork::is_completed() const {
  if (waited_) return true;
  for (const auto& b : buckets_) {
    if (!b.work->isCompleted()) return false;
  }
  return true;
}

CoalescedWork broadcast_coalesced(const Group& group, const std::vector<at::Tensor>& tensors,
                                  int src, int64_t bucket_cap_bytes) {
  check_dense(tensors, "broadcast_coalesced");
  TORCH_CHECK(src >= 0 && src < group.size(), "broadcast_coalesced: src=", src,
              " is not a rank of this group of ", group.size());
  CoalescedWork w;
  const bool me = group.rank() == src;
  for (const auto& idx : bucket_tensors(tensors, bucket_cap_bytes)) {
    std::vector<at::Tensor> members = pick(tensors, idx);
    at::Tensor flat = me ? ::dtrain::comm::flatten_dense_tensors(members)
                         : at::empty({total_numel(members)}, members[0].options());
    c10d::BroadcastOptions bo;
    bo.rootRank = src;
    std::vector<at::Tensor> v = {flat};
    CoalescedWork::Bucket b;
    b.work = group->broadcast(v, bo);
    if (!me) b.finish = [flat, members] { copy_back(flat, members); };
    w.buckets_.push_back(std::move(b));
  }
  return w;
}

CoalescedWork all_reduce_coalesced(const Group& group, const std::vector<at::Tensor>& tensors,
                                   c10d::ReduceOp op, int64_t bucket_cap_bytes) {
  check_dense(tensors, "all_reduce_coalesced");
  CoalescedWork w;
  for (const auto& idx : bucket_tensors(tensors, bucket_cap_bytes)) {
    std::vector<at::Tensor> members = pick(tensors, idx);
    at::Tensor flat = ::dtrain::comm::flatten_dense_tensors(members);
    c10d::AllreduceOptions ao;
    ao.reduceOp = op;
    std::vector<at::Tensor> v = {flat};
    CoalescedWork::Bucket b;
    b.work = group->allreduce(v, ao);
    b.finish = [flat, members] { copy_back(flat, members); };
    w.buckets_.push_back(std::move(b));
  }
  return w;
}

CoalescedWork all_gather_coalesced(const Group& group, const std::vector<at::Tensor>& inputs,
                                   const std::vector<std::vector<at::Tensor>>& outputs,
                                   int64_t bucket_cap_bytes) {
  check_dense(inputs, "all_gather_coalesced");
  const int n = group.size();
  TORCH_CHECK(static_cast<int>(outputs.size()) == n, "all_gather_coalesced: ", outputs.size(),
              " output lists for a group of ", n, " ranks");
  for (int r = 0; r < n; ++r) {
    TORCH_CHECK(outputs[r].size() == inputs.size(), "all_gather_coalesced: output list ", r,
                " has ", outputs[r].size(), " tensors, inputs have ", inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(outputs[r][i].sizes() == inputs[i].sizes() &&
                      outputs[r][i].scalar_type() == inputs[i].scalar_type(),
                  "all_gather_coalesced: outputs[", r, "][", i, "] is ", outputs[r][i].sizes(), " ",
                  outputs[r][i].scalar_type(), ", input ", i, " is ", inputs[i].sizes(), " ",
                  inputs[i].scalar_type());
    }
  }
  CoalescedWork w;
  for (const auto& idx : bucket_tensors(inputs, bucket_cap_bytes)) {
    std::vector<at::Tensor> members = pick(inputs, idx);
    at::Tensor flat = ::dtrain::comm::flatten_dense_tensors(members);
    std::vector<std::vector<at::Tensor>> recv(1);
    std::vector<std::vector<at::Tensor>> targets;
    for (int r = 0; r < n; ++r) {
      recv[0].push_back(at::empty_like(flat));
      targets.push_back(pick(outputs[r], idx));
    }
    std::vector<at::Tensor> v = {flat};
    CoalescedWork::Bucket b;
    b.work = group->allgather(recv, v);
    b.finish = [bufs = recv[0], targets] {
      for (size_t r = 0; r < bufs.size(); ++r) copy_back(bufs[r], targets[r]);
    };
    w.buckets_.push_back(std::move(b));
  }
  return w;
}

at::Tensor wire_view(const at::Tensor& t) {
  if (t.scalar_type() != at::kBFloat16 && t.scalar_type() != at::kHalf) return t;
  if (t.dim() == 0) return t.view({1}).view(at::kByte);
  return t.stride(-1) == 1 ? t.view(at::kByte) : t;
}

}  // namespace dtrain::comm
