#!/usr/bin/env bash
# Runs //rpc:parameter_server_example as a user would and checks both trainers' loss fell.
set -uo pipefail
out=$(rpc/parameter_server_example --steps=100 2>&1); code=$?
echo "$out" | grep -v "tensorpipe_agent.cpp" | tail -8
[[ $code -eq 0 ]] || { echo "FAIL: exit code $code"; exit 1; }
for t in trainer0 trainer1; do
  line=$(echo "$out" | grep "$t: loss") || { echo "FAIL: no summary from $t"; exit 1; }
  first=$(echo "$line" | sed -n 's/.*loss \([0-9.]*\) at step 1 .*/\1/p')
  last=$(echo "$line" | sed -n 's/.*-> \([0-9.]*\) at step.*/\1/p')
  awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < f / 2) }' || { echo "FAIL: $t loss $first -> $last did not halve"; exit 1; }
done
echo "both trainers' loss at least halved"
# A bad RANK is one clear line, not an abort.
for bad in 7 -1 abc; do
  err=$(RANK=$bad WORLD_SIZE=4 rpc/parameter_server_example 2>&1); code=$?
  [[ $code -eq 1 ]] || { echo "FAIL: RANK=$bad exited $code: $err"; exit 1; }
  echo "$err" | grep -q "RANK=$bad is not a rank of this example" || { echo "FAIL: RANK=$bad said: $err"; exit 1; }
done
echo "bad RANK values are one clear error"
