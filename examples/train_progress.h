// examples:train's progress lines: rank 0 redraws one line on a terminal, else prints one every
// log_every steps; note() prints a line of its own.
//
//   Progress progress(rank == 0, tty, /*total=*/300, /*log_every=*/0);
//   if (progress.due(step)) progress.show(step, loss, steps_per_s, state_bytes);
#ifndef DTRAIN_EXAMPLES_TRAIN_PROGRESS_H_
#define DTRAIN_EXAMPLES_TRAIN_PROGRESS_H_

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/strings/str_format.h"

namespace dtrain::examples {

inline std::string kib(int64_t bytes) {
  return absl::StrFormat("%.1f KiB", static_cast<double>(bytes) / 1024);
}

class Progress {
 public:
  // `tty`: whether rank 0 writes to a terminal, the same value on every rank (reporting involves a
  // collective, so every rank must agree on when it happens).
  Progress(bool enabled, bool tty, int total, int log_every)
      : enabled_(enabled), total_(total), tty_(tty) {
    every_ = log_every > 0 ? log_every : std::max(1, total / 10);
  }
  // Whether step `step` (1-based) reports: every step on a terminal, else every log_every.
  bool due(int step) const { return tty_ || step % every_ == 0 || step == total_; }
  void show(int step, double loss, double steps_per_s, int64_t state) {
    if (!enabled_) return;
    const std::string line =
        absl::StrFormat("step %*d/%d  loss %.6f  %.1f steps/s  optimizer state %s/rank",
                        static_cast<int>(std::to_string(total_).size()), step, total_, loss,
                        steps_per_s, kib(state));
    if (tty_) {
      std::printf("\r%s\x1b[K", line.c_str());
      if (step == total_) std::printf("\n");
    } else {
      std::printf("%s\n", line.c_str());
    }
    std::fflush(stdout);
  }
  void note(const std::string& message) {
    if (!enabled_) return;
    std::printf("%s\n", message.c_str());
    std::fflush(stdout);
  }

 private:
  bool enabled_;
  int total_;
  bool tty_;
  int every_ = 1;
};

}  // namespace dtrain::examples

#endif  // DTRAIN_EXAMPLES_TRAIN_PROGRESS_H_
