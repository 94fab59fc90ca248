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
# A flag out of range is one line and exit code 2 before any rank starts (issue 29: --steps=-5
# exited 0 printing "loss nan at step 1 -> nan at step -5").
for bad in --steps=-5 --steps=0 --steps=1000001 --steps=99999999999 --lr=0 --lr=-0.5 --lr=11; do
  err=$(rpc/parameter_server_example "$bad" 2>&1); code=$?
  [[ $code -eq 2 ]] || { echo "FAIL: $bad exited $code: $err"; exit 1; }
  [[ $(printf '%s\n' "$err" | wc -l) -eq 1 ]] || { echo "FAIL: $bad: expected one line, got: $err"; exit 1; }
  [[ "$err" == "parameter_server_example: ${bad%%=*} must be in "*", got "* ]] || { echo "FAIL: $bad said: $err"; exit 1; }
done
echo "out-of-range flags are one clear error"
