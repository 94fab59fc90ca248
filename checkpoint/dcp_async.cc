#include "checkpoint/dcp_async.h"

#include <sys/mman.h>

#include <ATen/ATen.h>

#include <cstdint>

#include <utility>

#include "absl/strings/str_cat.h"

namespace dtrain::checkpoint {

namespace {

// A host buffer for `src`: pinned for device tensors; large ones advised as huge pages (fewer
// page faults on the first copy).
at::Tensor new_buffer(const at::Tensor& src) {
  at::Tensor b =
      at::empty(src.sizes(), src.options().device(at::kCPU).pinned_memory(!src.is_cpu()));
  const size_t bytes = b.nbytes();
  constexpr size_t kHuge = size_t{2} << 20;
  if (src.is_cpu() && bytes >= 2 * kHuge) {
    const auto begin = reinterpret_cast<uintptr_t>(b.data_ptr());
    const uintptr_t aligned = (begin + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t end = (begin + bytes) & ~(kHuge - 1);
    if (end > aligned) ::madvise(reinterpret_cast<void*>(aligned), end - aligned, MADV_HUGEPAGE);
  }
  return b;
}

bool fits(const at::Tensor& buffer, const at::Tensor& src) {
  return buffer.defined() && buffer.sizes() == src.sizes() && buffer.dtype() == src.dtype() &&
         buffer.is_pinned() == !src.is_cpu();
}

}  // namespace

absl::StatusOr<std::vector<DcpWriteItem>> stage_dcp_items(const std::vector<DcpWriteItem>& mine,
                                                          std::vector<at::Tensor>* buffers) {
  std::vector<DcpWriteItem> staged = mine;
  std::vector<at::Tensor> used;
  bool on_device = false;
  try {
    size_t next = 0;
    for (DcpWriteItem& item : staged) {
      if (!item.tensor.defined()) continue;
      const at::Tensor src = item.tensor.detach();
      at::Tensor b = next < buffers->size() && fits((*buffers)[next], src) ? (*buffers)[next]
                                                                           : new_buffer(src);
      ++next;
      b.copy_(src, /*non_blocking=*/!src.is_cpu());
      on_device = on_device || !src.is_cpu();
      item.tensor = b;
      used.push_back(b);
    }
    if (on_device) {
      for (const DcpWriteItem& item : mine) {
        if (item.tensor.defined() && !item.tensor.is_cpu() && item.tensor.numel() > 0) {
          // One synchronisation of the stream the copies were queued on: a blocking copy of one
          // element after them.
          (void)item.tensor.reshape({-1}).narrow(0, 0, 1).to(at::kCPU);
          break;
        }
      }
    }
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("AsyncDcpSaver: staging the checkpoint in host memory failed: ",
                     std::string(e.what()).substr(0, 300)));
  }
  *buffers = std::move(used);
  return staged;
}

AsyncDcpSaver::AsyncDcpSaver(comm::Group group) : group_(std::move(group)) {}

AsyncDcpSaver::~AsyncDcpSaver() { (void)wait(); }

absl::Status AsyncDcpSaver::wait() {
  if (writer_.joinable()) writer_.join();
  absl::Status r = result_;
  result_ = absl::OkStatus();
  return r;
}

absl::Status AsyncDcpSaver::save(const std::string& dir, const std::vector<DcpWriteItem>& mine,
                                 const DcpSaveOptions& options) {
  if (absl::Status previous = wait(); !previous.ok()) {
    return absl::Status(previous.code(), absl::StrCat("the previous asynchronous save failed: ",
                                                      previous.message()));
  }
  absl::StatusOr<std::vector<DcpWriteItem>> staged = stage_dcp_items(mine, &staging_);
  if (!staged.ok()) return staged.status();
  writer_ = std::thread([this, dir, options, items = std::move(*staged)]() {
    result_ = save_dcp(group_, dir, items, options);
  });
  return absl::OkStatus();
}

}  // namespace dtrain::checkpoint
