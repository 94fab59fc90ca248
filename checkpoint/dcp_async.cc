#include "checkpoint/dcp_async.h"

#include <ATen/ATen.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace dtrain::checkpoint {

absl::StatusOr<std::vector<DcpWriteItem>> stage_dcp_items(const std::vector<DcpWriteItem>& mine) {
  std::vector<DcpWriteItem> staged = mine;
  bool on_device = false;
  try {
    for (DcpWriteItem& item : staged) {
      if (!item.tensor.defined()) continue;
      const at::Tensor src = item.tensor.detach();
      if (src.is_cpu()) {
        item.tensor = src.clone(at::MemoryFormat::Contiguous);
      } else {
        at::Tensor host = at::empty(src.sizes(), src.options().device(at::kCPU).pinned_memory(true));
        host.copy_(src, /*non_blocking=*/true);
        item.tensor = host;
        on_device = true;
      }
    }
    if (on_device) {
      for (const DcpWriteItem& item : mine) {
        if (item.tensor.defined() && !item.tensor.is_cpu()) {
          // One synchronisation of the device the copies were queued on.
          item.tensor.to(at::kCPU).numel();
          break;
        }
      }
    }
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "AsyncDcpSaver: staging the checkpoint in host memory failed: ", std::string(e.what()).substr(0, 300)));
  }
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
    return absl::Status(previous.code(),
                        absl::StrCat("the previous asynchronous save failed: ", previous.message()));
  }
  absl::StatusOr<std::vector<DcpWriteItem>> staged = stage_dcp_items(mine);
  if (!staged.ok()) return staged.status();
  writer_ = std::thread([this, dir, options, items = std::move(*staged)]() {
    result_ = save_dcp(group_, dir, items, options);
  });
  return absl::OkStatus();
}

}  // namespace dtrain::checkpoint
