#!/usr/bin/env bash
# Runs //examples:train as a user would: the loss falls, a resumed run ends exactly where an
# uninterrupted one does (also from sharded optimizer state, and after a crash restarted by
# --max_restarts), PyTorch reads the checkpoint, and bad input gets a one-line error.
set -uo pipefail
TRAIN=examples/train
PYTHON="${DTRAIN_PYTHON:-/usr/bin/python3}"  # PyTorch, the oracle (as the C++ tests take it)
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

final_loss() { sed -n 's/.*final loss \([0-9.]*\) at step.*/\1/p' "$1"; }
digest() { sed -n 's/^| weights digest | \([0-9a-f]*\) |$/\1/p' "$1"; }
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

# 2c'. Post-local SGD in DCP checkpoints: rank 0's model and Adam state (the ranks agree at a
# step that averages: every 4th) and the averager's step ("optim.step", where PyTorch's
# PostLocalSGDOptimizer.state_dict() keeps it). Resumed from DCP, the run ends with the weights
# the same resume from torch_save ends with, to the bit (the loss cannot tell: it is at its floor),
# and the averager resumes at the saved step (on one node post-local SGD's subgroup is the whole
# world, so the weights alone could not tell a lost averager step).
for fmt in torch_save dcp; do
  "$TRAIN" --steps=20 --hook=post_local_sgd --zero=off --checkpoint_format=$fmt --checkpoint_dir="$TMP/pl_$fmt" >"$TMP/pl_$fmt.1.log" 2>&1 || fail "post-local SGD $fmt first half exited with $?: $(cat "$TMP/pl_$fmt.1.log")"
  "$TRAIN" --steps=40 --resume --hook=post_local_sgd --zero=off --checkpoint_format=$fmt --checkpoint_dir="$TMP/pl_$fmt" >"$TMP/pl_$fmt.2.log" 2>&1 || fail "post-local SGD $fmt resume exited with $?: $(cat "$TMP/pl_$fmt.2.log")"
done
echo "post-local SGD resume: weights $(digest "$TMP/pl_dcp.2.log") from dcp, $(digest "$TMP/pl_torch_save.2.log") from torch_save"
for fmt in torch_save dcp; do
  grep -q "averager at step 20" "$TMP/pl_$fmt.2.log" || fail "post-local SGD's averager did not resume at step 20 from $fmt: $(cat "$TMP/pl_$fmt.2.log")"
done
[[ -n "$(digest "$TMP/pl_dcp.2.log")" && "$(digest "$TMP/pl_dcp.2.log")" == "$(digest "$TMP/pl_torch_save.2.log")" ]] || fail "post-local SGD resumed from dcp ends with weights $(digest "$TMP/pl_dcp.2.log"), from torch_save at $(digest "$TMP/pl_torch_save.2.log")"

# 2d. ZeRO-2 (--zero=stage2: gradients reduce-scattered, sharded): the same training as ZeRO-1 up
# to summation order, straight and resumed from ZeRO-1's step-20 checkpoint.
close() { awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && b != "" && d <= 1e-3 * b) }'; }
"$TRAIN" --steps=40 --zero=stage2 --checkpoint_dir="$TMP/z2" >"$TMP/z2.log" 2>&1 || fail "--zero=stage2 exited with $?: $(cat "$TMP/z2.log")"
echo "--zero=stage2: final loss $(final_loss "$TMP/z2.log") (ZeRO-1: $last)"
close "$(final_loss "$TMP/z2.log")" "$last" || fail "--zero=stage2 ends at loss $(final_loss "$TMP/z2.log"), ZeRO-1 at $last"
"$TRAIN" --steps=20 --checkpoint_dir="$TMP/z2r" >"$TMP/z2r.1.log" 2>&1 || fail "ZeRO-1 run for the stage2 resume exited with $?: $(cat "$TMP/z2r.1.log")"
"$TRAIN" --steps=40 --resume --zero=stage2 --checkpoint_dir="$TMP/z2r" >"$TMP/z2r.log" 2>&1 || fail "stage2 resume exited with $?: $(cat "$TMP/z2r.log")"
close "$(final_loss "$TMP/z2r.log")" "$last" || fail "stage2 resumed from ZeRO-1 ends at loss $(final_loss "$TMP/z2r.log"), ZeRO-1 at $last"
# ZeRO-2's shards in a DCP checkpoint (each rank its chunks): its resume ends where it would have.
"$TRAIN" --steps=20 --zero=stage2 --checkpoint_format=dcp --checkpoint_dir="$TMP/z2d" >"$TMP/z2d1.log" 2>&1 || fail "stage2 dcp first half exited with $?: $(cat "$TMP/z2d1.log")"
"$TRAIN" --steps=40 --resume --zero=stage2 --checkpoint_format=dcp --checkpoint_dir="$TMP/z2d" >"$TMP/z2d2.log" 2>&1 || fail "stage2 dcp resume exited with $?: $(cat "$TMP/z2d2.log")"
"$TRAIN" --steps=20 --zero=stage2 --checkpoint_dir="$TMP/z2t" >/dev/null 2>&1 || fail "stage2 torch_save first half failed"
"$TRAIN" --steps=40 --resume --zero=stage2 --checkpoint_dir="$TMP/z2t" >"$TMP/z2t2.log" 2>&1 || fail "stage2 torch_save resume exited with $?: $(cat "$TMP/z2t2.log")"
echo "stage2 resume: weights $(digest "$TMP/z2d2.log") from dcp, $(digest "$TMP/z2t2.log") from torch_save"
[[ -n "$(digest "$TMP/z2d2.log")" && "$(digest "$TMP/z2d2.log")" == "$(digest "$TMP/z2t2.log")" ]] || fail "stage2 resumed from dcp ends with weights $(digest "$TMP/z2d2.log"), from torch_save at $(digest "$TMP/z2t2.log")"

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
"$PYTHON" - "$TMP/a/checkpoint.pt" <<'PY' || fail "torch.load could not read the checkpoint"
import sys, torch
# weights_only=True: what PyTorch 2.6+ does by default (1.13's weights-only loader cannot read floats)
ckpt = torch.load(sys.argv[1], weights_only=tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 0))
assert ckpt["step"] == 40, ckpt["step"]
assert ckpt["model"]["0.weight"].shape == (256, 32), ckpt["model"]["0.weight"].shape
state = ckpt["optimizer"]["state"]
assert len(state) == 8 and "exp_avg" in state[0], list(state)
print("torch.load: step", ckpt["step"], "with", len(state), "parameter states")
PY

# 3b. --state_dtype: Adam's state in bfloat16 or 8 bits. The loss still halves, each rank's state
# is smaller than float32's, a resumed run ends where the straight one does (to the printed digit),
# PyTorch reads the checkpoint, and 8-bit state is refused where ZeRO cuts its blocks.
kib() { sed -n "s/^| optimizer state, rank 0 | \([0-9.]*\) KiB.*/\1/p" "$1"; }
for dtype in bfloat16 8bit; do
  "$TRAIN" --steps=40 --state_dtype=$dtype --checkpoint_dir="$TMP/q-$dtype" >"$TMP/q-$dtype.log" 2>&1 || fail "--state_dtype=$dtype exited with $?: $(cat "$TMP/q-$dtype.log")"
  q_last=$(final_loss "$TMP/q-$dtype.log")
  echo "--state_dtype=$dtype: final loss $q_last (float32: $last), state $(kib "$TMP/q-$dtype.log") KiB/rank (float32: $(kib "$TMP/a.log"))"
  awk -v f="$first" -v l="$q_last" 'BEGIN { exit !(l < f / 2) }' || fail "--state_dtype=$dtype: loss did not halve: $first -> $q_last"
  awk -v q="$(kib "$TMP/q-$dtype.log")" -v f="$(kib "$TMP/a.log")" 'BEGIN { exit !(q < f * 0.6) }' || fail "--state_dtype=$dtype: state $(kib "$TMP/q-$dtype.log") KiB/rank, float32 $(kib "$TMP/a.log")"
  "$TRAIN" --steps=20 --state_dtype=$dtype --checkpoint_dir="$TMP/qr-$dtype" >/dev/null 2>&1 || fail "--state_dtype=$dtype first half failed"
  "$TRAIN" --steps=40 --resume --state_dtype=$dtype --checkpoint_dir="$TMP/qr-$dtype" >"$TMP/qr-$dtype.log" 2>&1 || fail "--state_dtype=$dtype resume exited with $?: $(cat "$TMP/qr-$dtype.log")"
  [[ "$(final_loss "$TMP/qr-$dtype.log")" == "$q_last" ]] || fail "--state_dtype=$dtype resumed ends at loss $(final_loss "$TMP/qr-$dtype.log"), straight at $q_last"
  "$PYTHON" - "$TMP/q-$dtype/checkpoint.pt" "$dtype" <<'PY' || fail "torch.load could not read the --state_dtype=$dtype checkpoint"
import sys, torch
ckpt = torch.load(sys.argv[1], weights_only=tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 0))
state, group = ckpt["optimizer"]["state"][0], ckpt["optimizer"]["param_groups"][0]
assert group["state_dtype"] == sys.argv[2], group
if sys.argv[2] == "bfloat16":
    assert state["exp_avg"].dtype == torch.bfloat16, state["exp_avg"].dtype
else:
    assert "exp_avg" not in state and state["exp_avg_codes"].dtype == torch.uint8, list(state)
    assert state["exp_avg_absmax"].numel() == (state["exp_avg_codes"].numel() + 255) // 256
print("torch.load:", sys.argv[2], "state", sorted(state))
PY
done
out=$("$TRAIN" --steps=2 --state_dtype=8bit --zero=flat --checkpoint_dir= 2>&1) && fail "--state_dtype=8bit --zero=flat was accepted"
grep -q "state_dtype=8bit quantises blocks of whole parameters" <<<"$out" || fail "--state_dtype=8bit --zero=flat: $out"

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

# 4b. DCP checkpoints (--checkpoint_format=dcp): each rank writes its part of step-N/dcp/; resuming
# ends where the straight run does; 3 ranks with the flat partition read the same directory;
# PyTorch's dcp.load reads it into an nn.Sequential + torch.optim.Adam and saves its own DCP
# checkpoint, from which --init_from_dcp continues to the straight run's loss.
"$TRAIN" --steps=20 --checkpoint_format=dcp --checkpoint_dir="$TMP/d" >"$TMP/d1.log" 2>&1 || fail "dcp first half exited with $?: $(cat "$TMP/d1.log")"
ls "$TMP/d/latest/dcp/.metadata" "$TMP/d/latest/dcp/__0_0.distcp" "$TMP/d/latest/dcp/__1_0.distcp" >/dev/null 2>&1 || fail "no DCP files per rank in $TMP/d/latest/dcp: $(ls -aR "$TMP/d")"
cp -r "$TMP/d" "$TMP/d3" && cp -r "$TMP/d/latest/dcp" "$TMP/d20"
"$TRAIN" --steps=40 --resume --checkpoint_format=dcp --checkpoint_dir="$TMP/d" >"$TMP/d2.log" 2>&1 || fail "dcp resume exited with $?: $(cat "$TMP/d2.log")"
echo "dcp resume: final loss $(final_loss "$TMP/d2.log")"
[[ "$(final_loss "$TMP/d2.log")" == "$last" ]] || fail "dcp resume ends at loss $(final_loss "$TMP/d2.log"), the straight run at $last"
"$TRAIN" --steps=30 --resume --nproc_per_node=3 --zero=flat --checkpoint_format=dcp --checkpoint_dir="$TMP/d3" >"$TMP/d3.log" 2>&1 || fail "3-rank flat dcp resume exited with $?: $(cat "$TMP/d3.log")"
grep -q "resumed from step 20" "$TMP/d3.log" || fail "3 ranks did not resume from dcp step 20: $(cat "$TMP/d3.log")"
"$PYTHON" - "$TMP/d20" "$TMP/py20" 2>"$TMP/py20.log" <<'PY' || fail "PyTorch could not load and re-save the DCP checkpoint: $(cat "$TMP/py20.log")"
import sys, warnings
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
warnings.simplefilter("ignore")
L, G = torch.nn.Linear, torch.nn.GELU
model = torch.nn.Sequential(L(32, 256), G(), L(256, 256), G(), L(256, 256), G(), L(256, 8))
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
msd, osd = get_state_dict(model, opt)
state = {"model": msd, "optim": osd, "step": 0}
dcp.load(state, checkpoint_id=sys.argv[1])
set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
assert state["step"] == 20, state["step"]
assert float(opt.state[model[0].weight]["step"]) == 20.0, opt.state[model[0].weight]["step"]
msd, osd = get_state_dict(model, opt)
dcp.save({"model": msd, "optim": osd, "step": 20}, checkpoint_id=sys.argv[2])
print("PyTorch: dcp.load of dtrain's step 20, re-saved")
PY
"$TRAIN" --steps=40 --init_from_dcp="$TMP/py20" --checkpoint_dir="$TMP/dpy" >"$TMP/dpy.log" 2>&1 || fail "--init_from_dcp of PyTorch's checkpoint exited with $?: $(cat "$TMP/dpy.log")"
grep -q "started from step 20 of DCP checkpoint" "$TMP/dpy.log" || fail "--init_from_dcp did not start from step 20: $(cat "$TMP/dpy.log")"
echo "--init_from_dcp of PyTorch's re-save: final loss $(final_loss "$TMP/dpy.log")"
[[ "$(final_loss "$TMP/dpy.log")" == "$last" ]] || fail "--init_from_dcp of PyTorch's checkpoint ends at loss $(final_loss "$TMP/dpy.log"), the straight run at $last"
out=$("$TRAIN" --steps=40 --init_from_dcp="$TMP/py20" --hidden=128 --checkpoint_dir="$TMP/dpy128" 2>&1); code=$?
# (Gloo's connection lines may come first.)
[[ $code -eq 2 && "$out" == *"train: rank 0: --init_from_dcp: DCP checkpoint $TMP/py20 has another shape for model.0.weight"* ]] || fail "--init_from_dcp into another --hidden: exit $code: $out"

# 4c. 8-bit state (--state_dtype=8bit) in DCP checkpoints: optim.state.<fqn>.<slot>_codes (uint8)
# and <slot>_absmax (float32), whole tensors from the rank that owns the parameter. Killed at step
# 25 and restarted from step 20's DCP checkpoint, a run ends with the straight run's weights to the
# bit, under --zero=sorted_greedy and without ZeRO; resumed at another world size (3 ranks, 1
# without ZeRO) it ends with the weights the same resume from torch_save ends with; PyTorch reads
# the layout (and its Adam refuses it); --zero=flat, which would cut its blocks, is refused.
"$TRAIN" --steps=40 --zero=off --state_dtype=8bit --checkpoint_dir="$TMP/q8-off" >"$TMP/q8-off.log" 2>&1 || fail "8-bit --zero=off exited with $?: $(cat "$TMP/q8-off.log")"
for zero in sorted_greedy off; do
  if [[ $zero == off ]]; then ts=q8-off world=1; else ts=q-8bit world=3; fi
  d="$TMP/q8d-$zero"
  "$TRAIN" --steps=40 --zero=$zero --state_dtype=8bit --checkpoint_format=dcp --checkpoint_every=10 --max_restarts=1 --fail_at_step=25 --checkpoint_dir="$d" >"$d.log" 2>&1 || fail "8-bit dcp --zero=$zero restarted run exited with $?: $(cat "$d.log")"
  grep -q "resumed from step 20 .* on restart 1" "$d.log" || fail "8-bit dcp --zero=$zero did not resume from step 20: $(cat "$d.log")"
  echo "8-bit dcp --zero=$zero: restarted run's weights $(digest "$d.log"), straight $(digest "$TMP/$ts.log")"
  [[ -n "$(digest "$d.log")" && "$(digest "$d.log")" == "$(digest "$TMP/$ts.log")" ]] || fail "8-bit dcp --zero=$zero restarted ends with weights $(digest "$d.log"), straight with $(digest "$TMP/$ts.log")"
  "$TRAIN" --steps=50 --resume --nproc_per_node=$world --zero=$zero --state_dtype=8bit --checkpoint_format=dcp --checkpoint_dir="$d" >"$d.w$world.log" 2>&1 || fail "8-bit dcp --zero=$zero resume at $world ranks exited with $?: $(cat "$d.w$world.log")"
  "$TRAIN" --steps=50 --resume --nproc_per_node=$world --zero=$zero --state_dtype=8bit --checkpoint_dir="$TMP/$ts" >"$TMP/$ts.w$world.log" 2>&1 || fail "8-bit torch_save --zero=$zero resume at $world ranks exited with $?: $(cat "$TMP/$ts.w$world.log")"
  grep -q "resumed from step 40" "$d.w$world.log" || fail "$world ranks did not resume from 8-bit dcp step 40: $(cat "$d.w$world.log")"
  echo "8-bit --zero=$zero resumed at $world ranks: weights $(digest "$d.w$world.log") from dcp, $(digest "$TMP/$ts.w$world.log") from torch_save"
  [[ -n "$(digest "$d.w$world.log")" && "$(digest "$d.w$world.log")" == "$(digest "$TMP/$ts.w$world.log")" ]] || fail "8-bit --zero=$zero resumed at $world ranks ends with weights $(digest "$d.w$world.log") from dcp, $(digest "$TMP/$ts.w$world.log") from torch_save"
done
"$PYTHON" - "$TMP/q8d-sorted_greedy/latest/dcp" "$TMP/q8d.pt" 2>"$TMP/q8d-py.log" <<'PY' || fail "PyTorch could not read the 8-bit DCP checkpoint, or its Adam took it: $(cat "$TMP/q8d-py.log")"
import sys, warnings
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict
warnings.simplefilter("ignore")
dcp_to_torch_save(sys.argv[1], sys.argv[2])
optim = torch.load(sys.argv[2])["optim"]
state, group = optim["state"]["0.weight"], optim["param_groups"][0]
assert group["state_dtype"] == "8bit", group
for slot in ("exp_avg", "exp_avg_sq"):
    codes, absmax = state[slot + "_codes"], state[slot + "_absmax"]
    assert slot not in state and codes.dtype == torch.uint8 and codes.shape == (256, 32), (slot, codes.dtype, codes.shape)
    assert absmax.dtype == torch.float32 and absmax.shape == (256 * 32 // 256,), (slot, absmax.dtype, absmax.shape)
L, G = torch.nn.Linear, torch.nn.GELU
model = torch.nn.Sequential(L(32, 256), G(), L(256, 256), G(), L(256, 256), G(), L(256, 8))
msd, osd = get_state_dict(model, torch.optim.Adam(model.parameters(), lr=3e-3))
try:
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=sys.argv[1])
except BaseException as e:  # CheckpointException is one
    assert "exp_avg" in str(e), e
else:
    sys.exit("torch.optim.Adam's dcp.load took 8-bit state")
print("PyTorch: 8-bit DCP state read as codes and absmax; Adam's dcp.load refuses it")
PY
out=$("$TRAIN" --steps=60 --resume --nproc_per_node=3 --zero=flat --checkpoint_format=dcp --checkpoint_dir="$TMP/q8d-off" 2>&1); code=$?
[[ $code -eq 2 && "$out" == *"holds 8-bit optimizer state"*"ZeRO's sorted_greedy partition"* ]] || fail "8-bit dcp resumed with --zero=flat: exit $code: $out"

# 5. Step directories: the last --keep_checkpoints steps are kept, `latest` names the newest.
[[ "$(readlink "$TMP/a/latest")" == "step-00000040" ]] || fail "latest -> $(readlink "$TMP/a/latest"), expected step-00000040"
[[ -d "$TMP/a/step-00000020" && -f "$TMP/a/step-00000040/checkpoint.pt" ]] || fail "steps kept: $(ls "$TMP/a")"

# 6. Bad input: exit code 2 and one line that says what to do.
for args in "--hook=foo" "--zero=nope" "--steps=0" "--resume --checkpoint_dir=$TMP/none" "--hook=post_local_sgd" "--zero=off --sharded_checkpoint" "--keep_checkpoints=0" "--max_restarts=-1" "--max_restarts=101" "--fail_at_step=-1" "--device=gpu" "--backend=mpi" "--backend=nccl" "--backend=nccl --device=cpu" "--powersgd_start_iter=1" "--nnodes=0" "--nnodes=2 --node_rank=2" "--nnodes=1073741824" "--master_port=70000" "--master_addr=" "--hidden=2000000000" "--hidden=0" "--batch_size=2000000" "--batch_size=65536 --hidden=16384" "--timeout_s=0" "--timeout_s=1000000" "--rendezvous_timeout_s=-5" "--log_every=-1" "--lr=inf" "--checkpoint_every=0" "--checkpoint_format=zip" "--checkpoint_format=dcp --sharded_checkpoint" "--init_from_dcp=$TMP/x --resume"; do
  out=$("$TRAIN" $args 2>&1); code=$?
  [[ $code -eq 2 ]] || fail "$args: exit code $code, expected 2"
  [[ $(printf '%s\n' "$out" | wc -l) -eq 1 ]] || fail "$args: expected one line, got: $out"
  [[ "$out" == train:* ]] || fail "$args: unexpected message: $out"
done
# A size flag out of range is refused at start-up, before anything is allocated, naming its range.
out=$("$TRAIN" --hidden=2000000000 2>&1)
[[ "$out" == "train: --hidden must be in [1, 16384] "*", got 2000000000" ]] || fail "--hidden=2000000000: unexpected message: $out"
# --help lists train's flags with their checks (they live in train_config.cc, not in train.cc).
out=$("$TRAIN" --help 2>&1)
[[ "$out" != *"No flags matched"* ]] || fail "--help lists no flags: $out"
for flag in "--hidden (Width of the student's hidden layers, 1-16384" "--steps (Total optimizer steps, at least 1" "--checkpoint_dir (Where checkpoints go" "--hook (DDP communication hook:" "--nproc_per_node (Ranks to launch on this machine, at least 1"; do
  [[ "$out" == *"$flag"* ]] || fail "--help does not list '$flag': $out"
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

# 6b. A --checkpoint_dir no checkpoint can be written to is refused by the launching process before
# it starts any rank: exit 2, one line naming the path and the problem, which starts "train:
# --checkpoint_dir=" (a rank's own check would say "train: rank R: ...", its launcher "launch: rank
# R exited ..." and its relayed lines "[rank R] ..."). Root writes through permissions, so as root
# (tests may run so) /proc, where no file can be created, stands in for a directory chmod 555 makes
# unwritable.
: >"$TMP/plain-file"
ln -s "$TMP/nowhere" "$TMP/dangling"
if [[ $(id -u) -eq 0 ]]; then
  unwritable=/proc; echo "running as root: /proc stands in for an unwritable directory"
else
  mkdir -p "$TMP/read-only" && chmod 555 "$TMP/read-only"; unwritable="$TMP/read-only"
fi
bad_dirs=(  # --checkpoint_dir | what the line must say about it
  "$TMP/plain-file|it is a regular file, not a directory"
  "$TMP/plain-file/sub|it cannot be created: $TMP/plain-file is a regular file, not a directory"
  "$unwritable|cannot write in it (creating $unwritable/.write-probe.tmp."
  "$TMP/dangling|it is a symbolic link to $TMP/nowhere, which does not exist"
  "$TMP/dangling/sub|it cannot be created: $TMP/dangling is a symbolic link to $TMP/nowhere, which does not exist"
)
for entry in "${bad_dirs[@]}"; do
  dir=${entry%%|*}; want=${entry#*|}
  out=$("$TRAIN" --steps=600 --checkpoint_every=500 --checkpoint_dir="$dir" 2>&1); code=$?
  echo "--checkpoint_dir=$dir: exit $code: $out"
  [[ $code -eq 2 ]] || fail "--checkpoint_dir=$dir: exit code $code, expected 2: $out"
  [[ $(printf '%s\n' "$out" | wc -l) -eq 1 ]] || fail "--checkpoint_dir=$dir: expected one line (no rank started), got: $out"
  [[ "$out" == "train: --checkpoint_dir=$dir: $want"* ]] || fail "--checkpoint_dir=$dir: expected 'train: --checkpoint_dir=$dir: $want...' from the launching process, got: $out"
done
[[ -L "$TMP/dangling" && ! -e "$TMP/nowhere" ]] || fail "a dangling --checkpoint_dir was changed"
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

# 8. Resuming, every rank checks what it loads before any collective and the ranks agree on the
# verdict: a bad file on rank 1 only stops both ranks with the same line, naming the file (exit 2;
# no abort, no hang, no rank training on alone). Rank 0 writes to the terminal, rank 1's lines come
# relayed as "[rank 1] ...".
same_line_on_both_ranks() {  # name, log, what the line must contain
  local name=$1 out=$2 want=$3 line0 line1
  line0=$(printf '%s\n' "$out" | grep -m1 '^train: rank 1: --resume: ')
  line1=$(printf '%s\n' "$out" | grep -m1 '^\[rank 1\] train: rank 1: --resume: ')
  [[ -n "$line0" && "[rank 1] $line0" == "$line1" ]] || fail "$name: not the same line on both ranks: $out"
  [[ "$line0" == *"$want"* ]] || fail "$name: the line does not name '$want': $out"
  [[ "$out" == *"terminate called"* || "$out" == *"Aborted"* || "$out" == *"code 134"* ]] && fail "$name: a rank aborted: $out"
  echo "$name: $line0"
}
cp -r "$TMP/pr-other" "$TMP/bad-hook"  # PowerSGD's state at step 20, compressing since step 10
printf 'X' | dd of="$TMP/bad-hook/latest/hook-rank1.pt" bs=1 seek=300 conv=notrunc 2>/dev/null
out=$("$TRAIN" --steps=40 --resume "${P[@]}" --checkpoint_dir="$TMP/bad-hook" 2>&1); code=$?
[[ $code -eq 2 ]] || fail "a damaged hook-rank1.pt: exit $code, expected 2: $out"
same_line_on_both_ranks "a damaged hook-rank1.pt" "$out" "step-00000020/hook-rank1.pt"
# The same file intact (checksum-valid, written by PyTorch) but with another 'iter'.
cp -r "$TMP/pr-other" "$TMP/bad-iter"
"$PYTHON" - "$TMP/bad-iter/latest/hook-rank1.pt" <<'PY' || fail "python could not rewrite hook-rank1.pt"
import sys, torch
state = torch.load(sys.argv[1], weights_only=True)
state["iter"] = 7
torch.save(state, sys.argv[1])
PY
out=$("$TRAIN" --steps=40 --resume "${P[@]}" --checkpoint_dir="$TMP/bad-iter" 2>&1); code=$?
[[ $code -eq 2 ]] || fail "hook-rank1.pt with 'iter' 7: exit $code, expected 2: $out"
same_line_on_both_ranks "hook-rank1.pt with 'iter' 7" "$out" "hook-rank1.pt: "
[[ "$out" == *"'iter'"* ]] || fail "hook-rank1.pt with 'iter' 7: the key is not named: $out"
# A P memory of the wrong size on rank 1 (it used to abort rank 0 inside Gloo at the first
# compressed step): refused at load, on both ranks, naming the file and the key.
cp -r "$TMP/pr-other" "$TMP/bad-p"
"$PYTHON" - "$TMP/bad-p/latest/hook-rank1.pt" <<'PY' || fail "python could not rewrite hook-rank1.pt"
import sys, torch
state = torch.load(sys.argv[1], weights_only=True)
state["p_memory_dict"][0] = torch.zeros(5)
torch.save(state, sys.argv[1])
PY
out=$("$TRAIN" --steps=40 --resume "${P[@]}" --checkpoint_dir="$TMP/bad-p" 2>&1); code=$?
[[ $code -eq 2 ]] || fail "hook-rank1.pt with a 5-element P memory: exit $code, expected 2: $out"
same_line_on_both_ranks "hook-rank1.pt with a 5-element P memory" "$out" "hook-rank1.pt"
[[ "$out" == *"p_memory_dict"* ]] || fail "hook-rank1.pt with a 5-element P memory: the key is not named: $out"
# Under ZeRO each rank loads its own parameters' optimizer state from checkpoint.pt: a bad entry
# names the file and the parameter's index in it (not its index in a rank's shard), on every rank.
cp -r "$TMP/b" "$TMP/bad-opt"  # step 40, ZeRO sorted_greedy over 2 ranks
"$PYTHON" - "$TMP/bad-opt/latest/checkpoint.pt" <<'PY' || fail "python could not rewrite checkpoint.pt"
import sys, torch
ckpt = torch.load(sys.argv[1], weights_only=True)
ckpt["optimizer"]["state"][5]["exp_avg"] = torch.zeros(3)
torch.save(ckpt, sys.argv[1])
PY
out=$("$TRAIN" --steps=60 --resume --checkpoint_dir="$TMP/bad-opt" 2>&1); code=$?
[[ $code -eq 2 ]] || fail "checkpoint.pt with a bad exp_avg: exit $code, expected 2: $out"
[[ "$out" == *"step-00000040/checkpoint.pt: 'optimizer': "*"'exp_avg' of parameter 5 "* ]] || fail "checkpoint.pt with a bad exp_avg: the file, key or index is not named: $out"
[[ "$out" == *"heartbeats"* ]] && fail "a bad file is not a heartbeat matter: $out"
echo "checkpoint.pt with a bad exp_avg: $(printf '%s\n' "$out" | grep -m1 '^train: ')"

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
