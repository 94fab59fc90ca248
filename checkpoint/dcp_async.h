// Asynchronous DCP saves (PyTorch's dcp.async_save): save() copies this rank's items into host
// memory and returns; a background thread writes them and commits the checkpoint
// (checkpoint/dcp.h's save_dcp) while training goes on.
//
//   // A group of its own: the background save's collectives must never interleave with the
//   // training loop's on one group (PyTorch's async_save takes a separate Gloo group likewise).
//   absl::StatusOr<comm::Group> saves = comm::new_group(world, all_ranks);
//   AsyncDcpSaver saver(*saves);
//   for (step...) {
//     ...
//     if (step % 100 == 0) {
//       absl::Status s = saver.save(absl::StrCat("/ckpt/step", step), items_of_this_rank);
//       if (!s.ok()) ...;   // the PREVIOUS save failed (reported once), or this one's staging
//     }
//   }
//   absl::Status last = saver.wait();   // the last save's outcome
//
// Guarantees: at most one save in flight (save() waits for the previous one first, which is
// also when a failed write is reported); staging copies every tensor (a CUDA tensor into pinned
// host memory, then one synchronisation), so the caller may change its tensors as soon as save()
// returns. The staging buffers are kept and reused while the items keep their shapes and dtypes
// (a training loop's do): a save after the first costs one copy into memory already mapped, at
// the price of one host copy of this rank's state held between saves (PyTorch's
// BlockingAsyncStager(cache_staged_state_dict=True); its default stages afresh each time); each save commits its own directory's .metadata last, atomically, so a crash at any
// moment leaves every earlier completed checkpoint loadable and the one in flight either complete
// or without .metadata (never read). The destructor waits for the save in flight.
// Thread safety: save() and wait() from one thread (the training loop).
#ifndef DTRAIN_CHECKPOINT_DCP_ASYNC_H_
#define DTRAIN_CHECKPOINT_DCP_ASYNC_H_

#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "checkpoint/dcp.h"
#include "comm/process_group.h"

namespace dtrain::checkpoint {

class AsyncDcpSaver {
 public:
  // `group`: every rank of the job, used by this saver's background saves only.
  explicit AsyncDcpSaver(comm::Group group);
  ~AsyncDcpSaver();
  AsyncDcpSaver(const AsyncDcpSaver&) = delete;
  AsyncDcpSaver& operator=(const AsyncDcpSaver&) = delete;

  // Collective over the group (each rank calls it for the same dir, in the same order): waits
  // for the save in flight, stages `mine`, starts writing it, returns. Errors: the previous
  // save's failure (then nothing new is started: call again to save), staging's (no memory:
  // ResourceExhausted). The write's own outcome comes from the next save() or wait().
  absl::Status save(const std::string& dir, const std::vector<DcpWriteItem>& mine,
                    const DcpSaveOptions& options = {});
  // Waits for the save in flight; its outcome (OK when none was in flight).
  absl::Status wait();

 private:
  comm::Group group_;
  std::vector<at::Tensor> staging_;  // reused host buffers, one per tensor item of the last save
  std::thread writer_;
  absl::Status result_;  // of the last finished save, written by writer_ before it ends
};

// This rank's items with every tensor copied to host memory (the staging step of save()): into
// `buffers` where they match the tensors' shapes, dtypes and kinds of memory, else into new
// buffers (large ones advised as transparent huge pages), which replace `buffers`.
// Errors: ResourceExhausted.
absl::StatusOr<std::vector<DcpWriteItem>> stage_dcp_items(const std::vector<DcpWriteItem>& mine,
                                                          std::vector<at::Tensor>* buffers);

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_DCP_ASYNC_H_
