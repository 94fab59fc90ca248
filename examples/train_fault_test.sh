#!/usr/bin/env bash
# Kills examples:train (kill -9 of the launching process; its ranks die with it) at random moments
# while it checkpoints every other step, then resumes until the run completes, many times, for
# single-file checkpoints (allreduce and powersgd hooks: model, optimizer and per-rank hook state)
# and sharded ones. Every outcome must be "resumed exactly" (the final loss of the uninterrupted
# run, to the printed digit) or "clear error, previous step intact"; anything else fails.
# KILLS (default 10 per variant) and SEED change the campaign.
set -uo pipefail
TRAIN=examples/train
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
KILLS="${KILLS:-10}"
RANDOM="${SEED:-1}"
# One job id for every launch: each checkpoint records it, and the final files are compared byte
# for byte with the uninterrupted run's.
COMMON=(--steps=60 --checkpoint_every=2 --hidden=32 --batch_size=16 --log_every=40 --rdzv_id=train-fault-test)
final_loss() { sed -n 's/.*final loss \([0-9.]*\) at step.*/\1/p' "$1"; }
exact=0; clear_error=0; other=0

campaign() {  # name, extra flags...
  local name=$1; shift
  "$TRAIN" "${COMMON[@]}" "$@" --checkpoint_dir="$TMP/$name-ref" >"$TMP/$name-ref.log" 2>&1 \
    || { echo "FAIL: $name reference run exited with $?: $(tail -3 "$TMP/$name-ref.log")"; other=$((other + 1)); return; }
  local want; want=$(final_loss "$TMP/$name-ref.log")
  for ((i = 0; i < KILLS; i++)); do
    local dir="$TMP/$name-$i"; rm -rf "$dir"
    "$TRAIN" "${COMMON[@]}" "$@" --checkpoint_dir="$dir" >"$dir.killed.log" 2>&1 &
    local pid=$!
    sleep "$(awk -v r=$RANDOM 'BEGIN { printf "%.3f", 0.3 + 1.7 * r / 32767 }')"
    kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
    local resume=(--resume); [[ -L "$dir/latest" ]] || resume=()
    local at; at=$(readlink "$dir/latest" 2>/dev/null || echo none)
    "$TRAIN" "${COMMON[@]}" "$@" "${resume[@]}" --checkpoint_dir="$dir" >"$dir.resumed.log" 2>&1; local code=$?
    local got; got=$(final_loss "$dir.resumed.log")
    # Killed after the last commit: nothing left to train, and no loss printed.
    grep -q "nothing to train" "$dir.resumed.log" && got=$want
    # The final step's files are byte for byte the uninterrupted run's (model, optimizer, shards).
    # (Shard file names carry a random save id; their contents are compared rank by rank.)
    local same=yes
    cmp -s "$dir/latest/checkpoint.pt" "$TMP/$name-ref/latest/checkpoint.pt" || same=no
    for shard in "$TMP/$name-ref/latest/optimizer"/shard-*.pt; do
      [[ -e "$shard" ]] || continue
      local r=${shard##*-}
      cmp -s "$shard" "$dir"/latest/optimizer/shard-*-"$r" || same=no
    done
    if [[ $code -eq 0 && "$got" == "$want" && $same == yes ]]; then
      exact=$((exact + 1))
    elif [[ $code -eq 2 && $(wc -l <"$dir.resumed.log") -eq 1 && "$at" != none && -d "$dir/$at" ]]; then
      clear_error=$((clear_error + 1)); echo "$name kill $i: clear error: $(cat "$dir.resumed.log")"
    else
      other=$((other + 1))
      echo "FAIL: $name kill $i (latest was $at): exit $code, final loss '$got' vs '$want', same final files: $same: $(tail -3 "$dir.resumed.log")"
    fi
  done
  echo "$name: $KILLS kills done"
}

campaign single --hook=allreduce
campaign powersgd --hook=powersgd --powersgd_start_iter=15  # compressing from step 15 of 60
campaign sharded --sharded_checkpoint --zero=flat
# A stopped rank (SIGSTOP) ends the job, naming it (README: within --timeout_s plus the heartbeat
# check, about 11 s here; the bound below is 10x that, so that a loaded machine cannot miss it).
"$TRAIN" --steps=100000 --log_every=1 --hidden=32 --batch_size=16 --checkpoint_dir= --timeout_s=5 \
  >"$TMP/stop.log" 2>&1 &
launcher=$!
# Stop rank 1 once the job trains (its first progress line), however long startup takes (under
# the sanitizers it takes longer than the bound this checks).
for _ in $(seq 1 240); do grep -q "^step " "$TMP/stop.log" 2>/dev/null && break; sleep 0.5; done
rank1=""
for d in /proc/[0-9]*; do  # the launcher's children (no pgrep in minimal images)
  p=${d#/proc/}
  [[ "$(awk '{print $4}' "$d/stat" 2>/dev/null)" == "$launcher" ]] || continue
  tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=1" && rank1=$p
done
if [[ -z "$rank1" ]]; then
  alive=no; kill -0 "$launcher" 2>/dev/null && alive=yes
  echo "FAIL: no rank 1 process under the launcher $launcher (launcher alive: $alive): $(tail -5 "$TMP/stop.log")"
  other=$((other + 1))
else
  start=$SECONDS
  kill -STOP "$rank1"
  for _ in $(seq 1 150); do kill -0 "$launcher" 2>/dev/null || break; sleep 1; done
  took=$((SECONDS - start))
  kill -CONT "$rank1" 2>/dev/null; kill -9 "$launcher" 2>/dev/null; wait "$launcher" 2>/dev/null
  if grep -q "rank 1 stopped responding" "$TMP/stop.log" && [[ $took -le 120 ]]; then
    echo "stopped rank 1: the job ended in ${took} s naming it: $(grep -o 'rank 1 stopped responding[^:]*' "$TMP/stop.log" | head -1)"
  else
    echo "FAIL: stopped rank 1: after ${took} s: $(tail -5 "$TMP/stop.log")"; other=$((other + 1))
  fi
fi

echo "outcomes: $exact resumed exactly, $clear_error clear error with the previous step intact, $other other"
[[ $other -eq 0 ]] || exit 1
