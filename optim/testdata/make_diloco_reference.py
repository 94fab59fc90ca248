"""DiLoCo's reference trajectories, written by PyTorch for optim:diloco_test.

Usage: python3 make_diloco_reference.py OUTDIR

Simulates W workers in one process, as torchft's DiLoCo defines the algorithm: every worker runs
torch.optim.AdamW on its own copy of the parameters (gradient p - target[rank]); after every
sync_every / fragments inner steps one fragment (in turn 0, 1, ...) synchronises: each worker's
pseudo-gradient (global - local) divided by W, summed over the workers in rank order, stepped by
torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True) on the global parameters, which every worker
then copies into its fragment. fragments=1 is plain DiLoCo. Writes OUTDIR/<case>.pt (the inputs,
the schedule and the final parameters) and OUTDIR/cases.txt (the case names).
"""

import os
import sys

import torch

SHAPES = [(4, 3), (5,), (2, 2)]
INNER = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
OUTER = dict(lr=0.7, momentum=0.9, nesterov=True)
# name, world size, sync_every, fragments, inner steps (ending mid-round)
CASES = [
    ("w1_f1", 1, 4, 1, 14),
    ("w2_f1", 2, 4, 1, 14),
    ("w3_f1", 3, 4, 1, 14),
    ("w2_f2", 2, 4, 2, 14),
    ("w3_f3", 3, 6, 3, 20),
]


def split_fragments(sizes, fragments):
    """dtrain's split: contiguous, fragment f starting at the first parameter whose preceding
    elements reach f/F of the total, moved so that no fragment is empty."""
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


def run(world, sync_every, fragments, steps, gen):
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    targets = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(world)]
    local = [[p.clone().requires_grad_() for p in init] for _ in range(world)]
    inner = [torch.optim.AdamW(local[r], foreach=False, **INNER) for r in range(world)]
    glob = [p.clone() for p in init]
    outer = torch.optim.SGD(glob, foreach=False, **OUTER)
    frags = split_fragments([p.numel() for p in init], fragments)
    local_step, outer_step = 0, 0
    for _ in range(steps):
        for r in range(world):
            for p, t in zip(local[r], targets[r]):
                p.grad = p.detach() - t
            inner[r].step()
        local_step += 1
        if local_step < sync_every // fragments:
            continue
        frag = frags[outer_step % fragments]
        with torch.no_grad():
            for i, g in enumerate(glob):
                g.grad = None
                if i not in frag:
                    continue
                for r in range(world):
                    d = (g - local[r][i]) / world
                    g.grad = d if g.grad is None else g.grad + d
            outer.step()
            for r in range(world):
                for i in frag:
                    local[r][i].copy_(glob[i])
        local_step, outer_step = 0, outer_step + 1
    return {
        "world": world,
        "sync_every": sync_every,
        "fragments": fragments,
        "steps": steps,
        "inner_lr": INNER["lr"],
        "inner_betas": list(INNER["betas"]),
        "inner_eps": INNER["eps"],
        "inner_weight_decay": INNER["weight_decay"],
        "outer_lr": OUTER["lr"],
        "outer_momentum": OUTER["momentum"],
        "init": init,
        "targets": targets,
        "fragment_params": frags,
        "final_local": [[p.detach().clone() for p in local[r]] for r in range(world)],
        "final_global": [g.detach().clone() for g in glob],
    }


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(43)
    for name, world, sync_every, fragments, steps in CASES:
        torch.save(run(world, sync_every, fragments, steps, gen), os.path.join(out, name + ".pt"))
    with open(os.path.join(out, "cases.txt"), "w") as f:
        f.write("\n".join(c[0] for c in CASES) + "\n")


if __name__ == "__main__":
    main()
