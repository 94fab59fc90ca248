#!/usr/bin/env bash
# Runs //examples:train as a user would: the loss falls, a resumed run ends exactly where an
# uninterrupted one does (also from sharded optimizer state, and after a crash restarted by
# --max_restarts), PyTorch reads the checkpoint, and bad input gets a one-line error.
set -uo pipefail
TRAIN=examples/train
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

final_loss() { sed -n 's/.*final loss \([0-9.]*\) at step.*/\1/p' "$1"; }
first_loss() { sed -n 's/^| loss | \([0-9.]*\) at step.*/\1/p' "$1"; }

# 1. An uninterrupted run of 40 steps.
"$TRAIN" --steps=40 --checkpoint_every=20 --checkpoint_dir="$TMP/a" >"$TMP/a.log" 2>&1 || fail "train exited with $?: $(cat "$TMP/a.log")"
first=$(first_loss "$TMP/a.log"); last=$(final_loss "$TMP/a.log")
echo "straight run: loss $first -> $last"
[[ -n "$first" && -n "$last" ]] || fail "no loss in the summary: $(cat "$TMP/a.log")"
awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < f / 2) }' || fail "loss did not halve: $first -> $last"
grep -q "optimizer state, rank 1" "$TMP/a.log" || fail "no per-rank state rows"

# 2. 20 steps, then --resume to 40: the same final loss, to the printed digit.
"$TRAIN" --steps=20 --checkpoint_dir="$TMP/b" >"$TMP/b1.log" 2>&1 || fail "first half exited with $?"
"$TRAIN" --steps=40 --resume --checkpoint_dir="$TMP/b" >"$TMP/b2.log" 2>&1 || fail "resume exited with $?: $(cat "$TMP/b2.log")"
grep -q "resumed from step 20" "$TMP/b2.log" || fail "no 'resumed from step 20': $(cat "$TMP/b2.log")"
resumed=$(final_loss "$TMP/b2.log")
echo "resumed run: final loss $resumed"
[[ "$resumed" == "$last" ]] || fail "resumed run ends at loss $resumed, the straight run at $last"

# 2b. --max_restarts: rank 1 kills itself (SIGKILL) before step 25 on the first attempt; the
# launcher restarts both ranks, which resume from step 20 and end where the straight run does.
"$TRAIN" --steps=40 --checkpoint_every=10 --max_restarts=1 --fail_at_step=25 --checkpoint_dir="$TMP/r" >"$TMP/r.log" 2>&1 || fail "restarted run exited with $?: $(cat "$TMP/r.log")"
grep -q "exited with code [0-9]*; restarting all ranks (attempt 2 of 2)" "$TMP/r.log" || fail "no restart line: $(cat "$TMP/r.log")"
grep -q "resumed from step 20 .* on restart 1" "$TMP/r.log" || fail "the restarted attempt did not resume from step 20: $(cat "$TMP/r.log")"
restarted=$(final_loss "$TMP/r.log")
echo "restarted run: final loss $restarted"
[[ "$restarted" == "$last" ]] || fail "restarted run ends at loss $restarted, the straight run at $last"
# A restart never resumes from another job's step: the directory holds run a's step 40, this job's
# rank 1 dies at step 5 before it commits anything, and the restarted attempt starts afresh.
cp -r "$TMP/a" "$TMP/r2"
"$TRAIN" --steps=40 --checkpoint_every=10 --max_restarts=1 --fail_at_step=5 --checkpoint_dir="$TMP/r2" >"$TMP/r2.log" 2>&1 || fail "restart over a stale step exited with $?: $(cat "$TMP/r2.log")"
grep -q "no step of this job was committed" "$TMP/r2.log" || fail "a restart resumed another job's step: $(cat "$TMP/r2.log")"
grep -q "resumed from" "$TMP/r2.log" && fail "a restart resumed another job's step: $(cat "$TMP/r2.log")"
[[ "$(final_loss "$TMP/r2.log")" == "$last" ]] || fail "restart over a stale step ends at loss $(final_loss "$TMP/r2.log"), the straight run at $last"
# Without --max_restarts the same crash ends the job with rank 1's code (128 + SIGKILL).
"$TRAIN" --steps=40 --checkpoint_every=10 --fail_at_step=25 --checkpoint_dir="$TMP/r0" >"$TMP/r0.log" 2>&1; code=$?
[[ $code -eq 137 ]] || fail "a crash without restarts: exit $code, expected 137: $(cat "$TMP/r0.log")"
grep -q "restarting" "$TMP/r0.log" && fail "restarted without --max_restarts"

# 2c. The seed's other configurations train to completion and the loss falls: post-local SGD
# (hook + PostLocalSGDOptimizer, no ZeRO) and ZeRO stepped inside the DDP hook.
for args in "--hook=post_local_sgd --zero=off" "--zero_overlap"; do
  name=${args//[^a-z]/_}
  "$TRAIN" --steps=40 --checkpoint_dir="$TMP/$name" $args >"$TMP/$name.log" 2>&1 || fail "$args exited with $?: $(cat "$TMP/$name.log")"
  f=$(first_loss "$TMP/$name.log"); l=$(final_loss "$TMP/$name.log")
  echo "$args: loss $f -> $l"
  awk -v f="$f" -v l="$l" 'BEGIN { exit !(f != "" && l != "" && l < f / 2) }' || fail "$args: loss did not halve: $f -> $l"
done

# 2d. ZeRO-2 (--zero=stage2: gradients reduce-scattered, sharded): the same training as ZeRO-1 up
# to summation order, straight and resumed from ZeRO-1's step-20 checkpoint.
close() { awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && b != "" && d <= 1e-3 * b) }'; }
"$TRAIN" --steps=40 --zero=stage2 --checkpoint_dir="$TMP/z2" >"$TMP/z2.log" 2>&1 || fail "--zero=stage2 exited with $?: $(cat "$TMP/z2.log")"
echo "--zero=stage2: final loss $(final_loss "$TMP/z2.log") (ZeRO-1: $last)"
close "$(final_loss "$TMP/z2.log")" "$last" || fail "--zero=stage2 ends at loss $(final_loss "$TMP/z2.log"), ZeRO-1 at $last"
"$TRAIN" --steps=20 --checkpoint_dir="$TMP/z2r" >/dev/null 2>&1 || fail "ZeRO-1 run for the stage2 resume failed"
"$TRAIN" --steps=40 --resume --zero=stage2 --checkpoint_dir="$TMP/z2r" >"$TMP/z2r.log" 2>&1 || fail "stage2 resume exited with $?: $(cat "$TMP/z2r.log")"
close "$(final_loss "$TMP/z2r.log")" "$last" || fail "stage2 resumed from ZeRO-1 ends at loss $(final_loss "$TMP/z2r.log"), ZeRO-1 at $last"

# 2e. PowerSGD's state resumes at another --steps (its start_powerSGD_iter is --powersgd_start_iter,
# not derived from --steps): 20 steps, then --resume to 40, ends where 40 straight steps do; a
# resume with another --powersgd_start_iter is refused, naming the setting.
P=(--hook=powersgd --powersgd_start_iter=10)
"$TRAIN" --steps=40 "${P[@]}" --checkpoint_dir="$TMP/p" >"$TMP/p.log" 2>&1 || fail "powersgd run exited with $?: $(cat "$TMP/p.log")"
"$TRAIN" --steps=20 "${P[@]}" --checkpoint_dir="$TMP/pr" >"$TMP/pr1.log" 2>&1 || fail "powersgd first half exited with $?: $(cat "$TMP/pr1.log")"
cp -r "$TMP/pr" "$TMP/pr-other"
"$TRAIN" --steps=40 --resume "${P[@]}" --checkpoint_dir="$TMP/pr" >"$TMP/pr2.log" 2>&1 || fail "powersgd resume exited with $?: $(cat "$TMP/pr2.log")"
echo "powersgd: final loss $(final_loss "$TMP/pr2.log") resumed, $(final_loss "$TMP/p.log") straight"
[[ -n "$(final_loss "$TMP/p.log")" && "$(final_loss "$TMP/pr2.log")" == "$(final_loss "$TMP/p.log")" ]] || fail "powersgd resumed at another --steps ends at loss $(final_loss "$TMP/pr2.log"), the straight run at $(final_loss "$TMP/p.log")"
out=$("$TRAIN" --steps=40 --resume --hook=powersgd --powersgd_start_iter=12 --checkpoint_dir="$TMP/pr-other" 2>&1); code=$?
[[ $code -eq 2 && "$out" == *"'start_powerSGD_iter' is 10 in the checkpoint but 12"* ]] || fail "another --powersgd_start_iter: exit $code: $out"

# 3. The checkpoint is a PyTorch file: torch.load reads it.
/usr/bin/python3 - "$TMP/a/checkpoint.pt" <<'PY' || fail "torch.load could not read the checkpoint"
import sys, torch
# weights_only=True: what PyTorch 2.6+ does by default (1.13's weights-only loader cannot read floats)
ckpt = torch.load(sys.argv[1], weights_only=tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 0))
assert ckpt["step"] == 40, ckpt["step"]
assert ckpt["model"]["0.weight"].shape == (256, 32), ckpt["model"]["0.weight"].shape
state = ckpt["optimizer"]["state"]
assert len(state) == 8 and "exp_avg" in state[0], list(state)
print("torch.load: step", ckpt["step"], "with", len(state), "parameter states")
PY

# 4. Sharded optimizer state (--sharded_checkpoint): each rank writes its own shard; resuming
# ends where the straight run does, another rank count and strategy read the same shards, and
# shards from another step than checkpoint.pt are refused.
"$TRAIN" --steps=20 --sharded_checkpoint --checkpoint_dir="$TMP/s" >"$TMP/s1.log" 2>&1 || fail "sharded first half exited with $?: $(cat "$TMP/s1.log")"
ls "$TMP/s/latest/optimizer"/shard-*-0.pt "$TMP/s/latest/optimizer"/shard-*-1.pt "$TMP/s/latest/optimizer/metadata.pt" >/dev/null 2>&1 || fail "no shard per rank in $TMP/s/latest/optimizer: $(ls -R "$TMP/s")"
cp -r "$TMP/s/latest/optimizer" "$TMP/step20-shards"
"$TRAIN" --steps=40 --resume --sharded_checkpoint --checkpoint_dir="$TMP/s" >"$TMP/s2.log" 2>&1 || fail "sharded resume exited with $?: $(cat "$TMP/s2.log")"
sharded=$(final_loss "$TMP/s2.log")
echo "sharded resume: final loss $sharded"
[[ "$sharded" == "$last" ]] || fail "sharded resume ends at loss $sharded, the straight run at $last"
cp -r "$TMP/s" "$TMP/s3"
"$TRAIN" --steps=50 --resume --nproc_per_node=3 --zero=flat --sharded_checkpoint --checkpoint_dir="$TMP/s3" >"$TMP/s3.log" 2>&1 || fail "3-rank flat resume exited with $?: $(cat "$TMP/s3.log")"
grep -q "resumed from step 40" "$TMP/s3.log" || fail "3 ranks did not resume from step 40: $(cat "$TMP/s3.log")"
grep -q "optimizer state, rank 2" "$TMP/s3.log" || fail "3-rank resume has no rank 2 row"
rm -rf "$TMP/s/latest/optimizer" && cp -r "$TMP/step20-shards" "$TMP/s/latest/optimizer"
out=$("$TRAIN" --steps=60 --resume --sharded_checkpoint --checkpoint_dir="$TMP/s" 2>&1) && fail "stale shards were accepted"
[[ "$out" == *"are not from step 40"* ]] || fail "stale shards: unexpected message: $out"
out=$("$TRAIN" --steps=60 --resume --zero=off --checkpoint_dir="$TMP/s" 2>&1); code=$?
[[ $code -eq 2 && "$out" == "train: --resume: this checkpoint's optimizer state is sharded"* ]] || fail "--zero=off on shards: exit $code: $out"

# 5. Step directories: the last --keep_checkpoints steps are kept, `latest` names the newest.
[[ "$(readlink "$TMP/a/latest")" == "step-00000040" ]] || fail "latest -> $(readlink "$TMP/a/latest"), expected step-00000040"
[[ -d "$TMP/a/step-00000020" && -f "$TMP/a/step-00000040/checkpoint.pt" ]] || fail "steps kept: $(ls "$TMP/a")"

# 6. Bad input: exit code 2 and one line that says what to do.
for args in "--hook=foo" "--zero=nope" "--steps=0" "--resume --checkpoint_dir=$TMP/none" "--hook=post_local_sgd" "--zero=off --sharded_checkpoint" "--keep_checkpoints=0" "--max_restarts=-1" "--max_restarts=101" "--fail_at_step=-1" "--device=gpu" "--backend=mpi" "--backend=nccl" "--backend=nccl --device=cpu" "--powersgd_start_iter=1" "--nnodes=0" "--nnodes=2 --node_rank=2" "--nnodes=1073741824" "--master_port=70000" "--master_addr="; do
  out=$("$TRAIN" $args 2>&1); code=$?
  [[ $code -eq 2 ]] || fail "$args: exit code $code, expected 2"
  [[ $(printf '%s\n' "$out" | wc -l) -eq 1 ]] || fail "$args: expected one line, got: $out"
  [[ "$out" == train:* ]] || fail "$args: unexpected message: $out"
done
out=$("$TRAIN" --backend=nccl --device=cpu 2>&1)
[[ "$out" == "train: --backend=nccl "*"--device=cuda"* ]] || fail "--backend=nccl --device=cpu: unexpected message: $out"
# --device=cuda where no GPU can be used (none visible: CUDA_VISIBLE_DEVICES is empty): one line,
# exit 2, before any rank starts -- "this build has no CUDA" or "no GPU is visible", by the build.
for backend in auto nccl gloo; do
  out=$(CUDA_VISIBLE_DEVICES= "$TRAIN" --device=cuda --backend=$backend 2>&1); code=$?
  [[ $code -eq 2 && $(printf '%s\n' "$out" | wc -l) -eq 1 ]] || fail "--device=cuda --backend=$backend without a GPU: exit $code, expected 2 and one line: $out"
  [[ "$out" == "train: --device=cuda: this build has no CUDA"* || "$out" == "train: --device=cuda: no GPU is visible"* ]] || fail "--device=cuda without a GPU: unexpected message: $out"
done

# 6b. A --checkpoint_dir no checkpoint can be written to is found before the first step (it used to
# be found at the first save, after training up to it): exit 2 in under 2 s, one line naming the
# path and the problem. Root writes through permissions, so as root (tests may run so) /proc, where
# no file can be created, stands in for a directory chmod 555 makes unwritable.
: >"$TMP/plain-file"
if [[ $(id -u) -eq 0 ]]; then
  unwritable=/proc; echo "running as root: /proc stands in for an unwritable directory"
else
  mkdir -p "$TMP/read-only" && chmod 555 "$TMP/read-only"; unwritable="$TMP/read-only"
fi
bad_dirs=(  # --checkpoint_dir | what the line must say about it
  "$TMP/plain-file|it is a regular file, not a directory"
  "$TMP/plain-file/sub|it cannot be created: $TMP/plain-file is a regular file, not a directory"
  "$unwritable|cannot write in it (creating $unwritable/.write-probe.tmp."
)
for entry in "${bad_dirs[@]}"; do
  dir=${entry%%|*}; want=${entry#*|}
  t0=$(date +%s%N)
  out=$("$TRAIN" --steps=600 --checkpoint_every=500 --checkpoint_dir="$dir" 2>&1); code=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  echo "--checkpoint_dir=$dir: exit $code after $ms ms: $out"
  [[ $code -eq 2 ]] || fail "--checkpoint_dir=$dir: exit code $code, expected 2: $out"
  [[ $(printf '%s\n' "$out" | wc -l) -eq 1 ]] || fail "--checkpoint_dir=$dir: expected one line, got: $out"
  [[ "$out" == "train: --checkpoint_dir=$dir: $want"* ]] || fail "--checkpoint_dir=$dir: expected 'train: --checkpoint_dir=$dir: $want...', got: $out"
  [[ $ms -lt 2000 ]] || fail "--checkpoint_dir=$dir: failed after $ms ms, expected under 2 s (before any training)"
done
[[ -d "$TMP/plain-file" || -e "$TMP/plain-file/sub" ]] && fail "a bad --checkpoint_dir was changed"
if [[ $(id -u) -ne 0 ]]; then chmod 755 "$TMP/read-only"; fi
# A save that fails mid-run (here: over the step the directory already committed, without --resume)
# ends the job with checkpoint/'s message, prefixed once, before any other rank's echo of it.
S=(--hidden=32 --batch_size=8 --checkpoint_every=2)
"$TRAIN" --steps=2 "${S[@]}" --checkpoint_dir="$TMP/again" >/dev/null 2>&1 || fail "a 2-step run failed"
out=$("$TRAIN" --steps=4 "${S[@]}" --checkpoint_dir="$TMP/again" 2>&1 >/dev/null); code=$?  # stderr only
first_error=$(printf '%s\n' "$out" | grep -m1 'train: ')
[[ $code -eq 1 ]] || fail "saving over the committed step: exit $code, expected 1: $out"
[[ "$first_error" == "train: checkpoint: step 2 is the committed step in $TMP/again;"* ]] || fail "saving over the committed step: the first error is not checkpoint/'s: $out"
[[ "$out" == *"checkpoint: checkpoint:"* ]] && fail "doubled 'checkpoint:' prefix: $out"

# 7. With a GPU and a CUDA build (skipped elsewhere): one rank per visible GPU trains on them, the
# summary says so, and a run resumed there ends where the straight one does.
# The launcher's GPU count check answers how many GPUs it sees (and launches nothing).
probe=$("$TRAIN" --device=cuda --nproc_per_node=100000 2>&1)
gpus=$(printf '%s\n' "$probe" | sed -n 's/.* GPUs but \([0-9]*\) are visible.*/\1/p')
if [[ "${gpus:-0}" -ge 1 ]]; then
  n=$(( gpus < 2 ? gpus : 2 ))
  G=(--device=cuda --nproc_per_node=$n)
  "$TRAIN" --steps=40 "${G[@]}" --checkpoint_dir="$TMP/g" >"$TMP/g.log" 2>&1 || fail "--device=cuda exited with $?: $(cat "$TMP/g.log")"
  grep -q "^| run | $n ranks on cuda (one GPU each, rank 0 on cuda:0, " "$TMP/g.log" || fail "--device=cuda: no cuda in the run line: $(cat "$TMP/g.log")"
  f=$(first_loss "$TMP/g.log"); l=$(final_loss "$TMP/g.log")
  echo "--device=cuda ($n GPU(s)): loss $f -> $l"
  awk -v f="$f" -v l="$l" 'BEGIN { exit !(f != "" && l != "" && l < f / 2) }' || fail "--device=cuda: loss did not halve: $f -> $l"
  "$TRAIN" --steps=20 "${G[@]}" --checkpoint_dir="$TMP/gr" >/dev/null 2>&1 || fail "--device=cuda first half failed"
  "$TRAIN" --steps=40 --resume "${G[@]}" --checkpoint_dir="$TMP/gr" >"$TMP/gr.log" 2>&1 || fail "--device=cuda resume exited with $?: $(cat "$TMP/gr.log")"
  close "$(final_loss "$TMP/gr.log")" "$l" || fail "--device=cuda resumed ends at loss $(final_loss "$TMP/gr.log"), straight at $l"
else
  echo "no usable GPU: the --device=cuda training checks are skipped"
fi

if [[ $fails -ne 0 ]]; then echo "$fails check(s) failed"; exit 1; fi
echo "all checks passed"
