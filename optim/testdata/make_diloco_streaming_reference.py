"""Streaming DiLoCo's reference trajectories with overlap, written by PyTorch for
optim:diloco_streaming_test.

Usage: python3 make_diloco_streaming_reference.py OUTDIR

Simulates W workers in one process, following torchft 0.2.0's DiLoCo and _StreamingDiLoCoFragment
(torchft/local_sgd.py) step for step. Every worker runs torch.optim.SGD (momentum) on its own copy
of the parameters (gradient p - target[rank]). With K = sync_every / fragments, after inner step
K - tau of a round (torchft's `_local_step == _sync_every - _fragment_sync_delay`) the round's
fragment (in turn 0, 1, ...) is prepared (prepare_sync): each worker's pseudo-gradient
original_parameters - local, averaged over the workers (as dtrain: each divided by W, summed in
rank order; torchft divides after the sum). After inner step K (perform_sync) each worker saves its
local fragment (_save_local_parameters), restores the original parameters (restore_parameters),
the outer optimizer torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True) steps them on that
average (_set_grads, step), they become the new original parameters (save_parameters), and the
local ones are lerped towards the saved ones by alpha (_merge_parameters: p.lerp_(local, alpha)).
Every worker's outer optimizer sees the same parameters and gradient, so one simulates them all.
Writes OUTDIR/<case>.pt and OUTDIR/cases.txt.
"""

import os
import sys

import torch

SHAPES = [(4, 3), (5,), (2, 2)]
INNER = dict(lr=0.1, momentum=0.5)
OUTER = dict(lr=0.7, momentum=0.9, nesterov=True)
STEPS = 19
# world sizes x (sync_every, fragments, tau) x alpha, plus tau 0 with alpha (the merge alone).
SCHEDULES = [(5, 1, 2), (8, 2, 3), (6, 2, 1)]
ALPHAS = [0.0, 0.5]


def cases():
    out = []
    for world in (1, 2, 3):
        for sync_every, fragments, tau in SCHEDULES:
            for alpha in ALPHAS:
                name = f"w{world}_h{sync_every}_f{fragments}_t{tau}_a{int(alpha * 10)}"
                out.append((name, world, sync_every, fragments, tau, alpha))
    out.append(("w2_h4_f2_t0_a5", 2, 4, 2, 0, 0.5))
    out.append(("w3_h6_f2_t2_a10", 3, 6, 2, 2, 1.0))
    return out


def split_fragments(sizes, fragments):
    """dtrain's split (as make_diloco_reference.py)."""
    n = len(sizes)
    before = [0]
    for s in sizes:
        before.append(before[-1] + s)
    start = [0] * (fragments + 1)
    start[fragments] = n
    for f in range(1, fragments):
        s = 0
        while s < n and before[s] * fragments < f * before[n]:
            s += 1
        start[f] = min(max(s, start[f - 1] + 1), n - (fragments - f))
    return [list(range(start[f], start[f + 1])) for f in range(fragments)]


def run(world, sync_every, fragments, tau, alpha, gen):
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    targets = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(world)]
    local = [[p.clone().requires_grad_() for p in init] for _ in range(world)]
    inner = [torch.optim.SGD(local[r], foreach=False, **INNER) for r in range(world)]
    original = [p.clone() for p in init]  # the fragments' original_parameters
    outer = torch.optim.SGD(original, foreach=False, **OUTER)
    frags = split_fragments([p.numel() for p in init], fragments)
    k = sync_every // fragments
    local_step, outer_step, averaged = 0, 0, None
    for _ in range(STEPS):
        for r in range(world):
            for p, t in zip(local[r], targets[r]):
                p.grad = p.detach() - t
            inner[r].step()
        local_step += 1
        frag = frags[outer_step % fragments]
        with torch.no_grad():
            if local_step == k - tau:  # prepare_sync: _save_grads, then the all-reduce
                averaged = {}
                for i in frag:
                    for r in range(world):
                        d = (original[i] - local[r][i]) / world
                        averaged[i] = d if i not in averaged else averaged[i] + d
            if local_step < k:
                continue
            # perform_sync: _save_local_parameters, restore_parameters, outer step, merge
            saved = [{i: local[r][i].detach().clone() for i in frag} for r in range(world)]
            for i, g in enumerate(original):
                g.grad = averaged[i] if i in frag else None
            outer.step()
            for r in range(world):
                for i in frag:
                    local[r][i].copy_(original[i])
                    local[r][i].lerp_(saved[r][i], alpha)
        local_step, outer_step, averaged = 0, outer_step + 1, None
    return {
        "world": world,
        "sync_every": sync_every,
        "fragments": fragments,
        "fragment_sync_delay": tau,
        "fragment_update_alpha": alpha,
        "steps": STEPS,
        "inner_lr": INNER["lr"],
        "inner_momentum": INNER["momentum"],
        "outer_lr": OUTER["lr"],
        "outer_momentum": OUTER["momentum"],
        "init": init,
        "targets": targets,
        "fragment_params": frags,
        "final_local": [[p.detach().clone() for p in local[r]] for r in range(world)],
        "final_global": [g.detach().clone() for g in original],
    }


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(43)
    names = []
    for name, world, sync_every, fragments, tau, alpha in cases():
        result = run(world, sync_every, fragments, tau, alpha, gen)
        torch.save(result, os.path.join(out, name + ".pt"))
        names.append(name)
    with open(os.path.join(out, "cases.txt"), "w") as f:
        f.write("\n".join(names) + "\n")


if __name__ == "__main__":
    main()
