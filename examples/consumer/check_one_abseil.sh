#!/usr/bin/env bash
# Run from examples/consumer after `bazel build //:zero_step`: every Abseil target in the program's
# dependency graph -- the consumer's own and dtrain's -- comes from one abseil-cpp module (Bazel's
# canonical name @@abseil-cpp~...), none from another copy (@com_google_absl or a second version).
# Prints "one Abseil: N targets from @@abseil-cpp~" (N counts its packages and the system libraries).
set -euo pipefail
labels=$(bazel query --noshow_progress --consistent_labels 'deps(//:zero_step)' --output=label 2>/dev/null)
absl=$(grep -iE 'absl|abseil' <<<"$labels" || true)
ours=$(grep -c '^@@abseil-cpp[~+]' <<<"$absl" || true)
others=$(grep -v '^@@abseil-cpp[~+]' <<<"$absl" | grep . || true)
if [[ -n "$others" || "$ours" -eq 0 ]]; then
  echo "more than one Abseil (or none) in //:zero_step's graph: $ours from @@abseil-cpp~, others:" >&2
  echo "$others" >&2
  exit 1
fi
echo "one Abseil: $ours targets from @@abseil-cpp~"
