// Step-versioned checkpoints committed atomically: everything a step saves (model, optimizer
// state in one file or in shards, per-rank hook state) goes into its own directory, and one final
// atomic rename makes that step current. Until then the previous complete step stays current and
// loadable; a crash at any point leaves either the old step or the new one current, never a mix.
//
//   dtrain::checkpoint::StepCheckpoints ckpts("/ckpt", /*keep=*/2);
//   absl::StatusOr<std::string> dir = ckpts.begin(step);   // "/ckpt/step-00000100", emptied
//   ... every rank writes its files under *dir (shards, hook-rank<r>.pt); rank 0 checkpoint.pt ...
//   absl::Status s = ckpts.commit(step);                   // after every write succeeded
//   absl::StatusOr<CommittedStep> last = ckpts.latest();   // {100, "/ckpt/step-00000100"}
//
// Layout under `root`: step-<8+ digits>/ (one per step, the current one and up to keep-1 older),
// `latest` (a symlink to the current step's directory: the commit point) and `checkpoint.pt` (a
// symlink to latest/checkpoint.pt, so `torch.load("/ckpt/checkpoint.pt")` reads the current step).
// commit() removes step directories older than the last `keep` committed ones, uncommitted step
// directories (an interrupted save) and temporary files ("*.tmp.*") left by killed writers.
//
// Thread safety: none; in a job, only one rank (rank 0) calls begin() and commit(), with a
// barrier after begin() (others then write) and before commit() (all writes done).
#ifndef DTRAIN_CHECKPOINT_STEP_CHECKPOINTS_H_
#define DTRAIN_CHECKPOINT_STEP_CHECKPOINTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dtrain::checkpoint {

struct CommittedStep {
  int64_t step = 0;
  std::string dir;  // root/step-<step>
};

class StepCheckpoints {
 public:
  // REQUIRES: keep >= 1. Nothing is touched until begin() or commit().
  StepCheckpoints(std::string root, int keep = 2);

  // The directory for `step` (0 <= step < 10^15), created empty under root (root too): the files
  // of an earlier, uncommitted attempt at this step are removed. Errors: InvalidArgument (step out
  // of range, or `step` is the committed one: saving over the current step would break the
  // guarantee), Unavailable/PermissionDenied (I/O, naming the path).
  absl::StatusOr<std::string> begin(int64_t step);

  // Makes `step` (whose directory begin() made and the caller filled) the current one, atomically,
  // durably (fsync of the new link and of root), then cleans up as described above. Errors:
  // FailedPrecondition (no directory for that step), I/O errors naming the path; on error the
  // previous step stays current.
  absl::Status commit(int64_t step);

  // The current step. NotFound when nothing was ever committed under root; DataLoss when `latest`
  // exists but does not name a step directory that exists (the message says what to do).
  absl::StatusOr<CommittedStep> latest() const;

  // Committed step directories present under root, oldest first (the current one last).
  std::vector<int64_t> steps_on_disk() const;

  const std::string& root() const { return root_; }
  std::string dir_of(int64_t step) const;

 private:
  std::string root_;
  int keep_;
};

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_STEP_CHECKPOINTS_H_
