#!/usr/bin/env bash
# Runs //rpc:seed_example (torch.distributed.optim's example) as a user would and checks the
# parameters on worker1 after the step: ones(2)+3 - 0.05 = 3.95 and ones(2)+1 - 0.05 = 1.95.
set -uo pipefail
out=$(rpc/seed_example 2>&1); code=$?
echo "$out" | grep -v "tensorpipe_agent.cpp" | tail -6
[[ $code -eq 0 ]] || { echo "FAIL: exit code $code"; exit 1; }
echo "$out" | grep -q "worker1: rref1 = \[3.9500, 3.9500\], rref2 = \[1.9500, 1.9500\]" \
  || { echo "FAIL: worker1 does not hold 3.95 and 1.95"; exit 1; }
echo "$out" | grep -q "worker0: rref1.to_here() = \[3.9500, 3.9500\], rref2.to_here() = \[1.9500, 1.9500\]" \
  || { echo "FAIL: worker0 does not fetch 3.95 and 1.95"; exit 1; }
echo "worker1 holds 3.95 and 1.95 after the step"
err=$(RANK=5 WORLD_SIZE=2 rpc/seed_example 2>&1); code=$?
[[ $code -eq 1 ]] && echo "$err" | grep -q "RANK=5 WORLD_SIZE=2 is not a rank of this example" \
  || { echo "FAIL: RANK=5 exited $code: $err"; exit 1; }
echo "a bad RANK is one clear error"
