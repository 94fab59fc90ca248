#!/usr/bin/python3
"""PyTorch's DistributedDataParallel on //ddp_hooks:ddp_benchmark's model, world 2 (two
processes, Gloo over loopback): 8 x Linear(1024, 1024) + ReLU, batch 2 per rank.
    /usr/bin/python3 bench/peers/ddp_pytorch.py
Prints the mean iteration time (zero_grad + forward + backward) with and without bucket views,
and backward alone."""
import sys

import torch
import torch.distributed as dist

from two_ranks import backward_ms, init_gloo, mlp, run_two_ranks, timed


def run(rank, port, q):
    init_gloo(rank, port)
    x = torch.randn(2, 1024)
    results = {"backward": backward_ms(x)}
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
