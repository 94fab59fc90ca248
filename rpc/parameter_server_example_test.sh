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
