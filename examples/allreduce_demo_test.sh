#!/usr/bin/env bash
# The launcher's hello world as a user runs it: //launcher:launch starts examples:allreduce_demo on
# two ranks, which all-reduce over Gloo and print the sum. (It lives here, not in launcher/, so
# that the launcher builds and tests without LibTorch: docs/ARCHITECTURE.md.)
set -uo pipefail
out=$(launcher/launch --nproc_per_node=2 -- examples/allreduce_demo 2>&1)
code=$?
fail=0
[[ $code -eq 0 ]] || { echo "FAIL: launch exited with $code"; fail=1; }
for r in 0 1; do
  want="[rank $r] rank $r of 2: allreduce sum = 3 (expected 3)"
  grep -qF "$want" <<<"$out" || { echo "FAIL: no line '$want'"; fail=1; }
done
[[ $fail -eq 0 ]] || { echo "--- launch's output:"; echo "$out"; exit 1; }
echo "PASS: two ranks launched, all-reduced and printed the sum"
