#!/usr/bin/python3
"""PyTorch's DistributedDataParallel on //ddp_hooks:ddp_benchmark's model, world 2 (two
processes, Gloo over loopback): 8 x Linear(1024, 1024) + ReLU, batch 2 per rank.
    /usr/bin/python3 bench/peers/ddp_pytorch.py
Prints the mean iteration time (zero_grad + forward + backward) with and without bucket views,
and backward alone."""
import os
import sys
import time

import torch
import torch.distributed as dist

from two_ranks import run_two_ranks

STEPS = int(os.environ.get("STEPS", "30"))


def mlp():
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def timed(fn):
    fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        fn()
    return (time.perf_counter() - t0) / STEPS * 1e3


def run(rank, port, q):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=2)
    x = torch.randn(2, 1024)
    plain = mlp()

    def backward_only():
        plain.zero_grad()
        plain(x).sum().backward()
    results = {"backward": timed(backward_only)}
    for view in (False, True):
        model = torch.nn.parallel.DistributedDataParallel(mlp(), gradient_as_bucket_view=view)

        def iteration():
            model.zero_grad()
            model(x).sum().backward()
        results["ddp_bucket_view" if view else "ddp"] = timed(iteration)
    if rank == 0:
        q.put(results)
    dist.destroy_process_group()


if __name__ == "__main__":
    items, code = run_two_ranks(run)
    for k, v in sorted(items[0].items()):
        print("%s %.1f ms" % (k, v))
    sys.exit(code)
