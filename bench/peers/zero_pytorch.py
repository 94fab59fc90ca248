#!/usr/bin/python3
"""PyTorch's ZeroRedundancyOptimizer on the shapes of //optim/zero:zero_redundancy_optimizer_benchmark, world 2 (two
processes, Gloo over loopback), Adam on 20M fp32 parameters:
    /usr/bin/python3 bench/peers/zero_pytorch.py
Prints one line per configuration: model, config, mean step time (ms), optimizer state MiB on
rank 0, consolidate_state_dict time (ms). THREADS=n sets torch.set_num_threads(n) per rank."""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from two_ranks import run_two_ranks

M = 1 << 20
MODELS = {"equal": [M] * 20, "dominant": [10 * M] + [M] * 10}
STEPS = int(os.environ.get("STEPS", "10"))


def run(rank, port, out):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=2)
    if os.environ.get("THREADS"):  # default: PyTorch's own choice, as a user gets it
        torch.set_num_threads(int(os.environ["THREADS"]))
    for model, sizes in MODELS.items():
        for bucket_view in (False, True):
            params = [torch.nn.Parameter(torch.full((n,), 0.5)) for n in sizes]
            for p in params:
                p.grad = torch.full((p.numel(),), 0.01)
            opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=1e-3,
                                          parameters_as_bucket_view=bucket_view)
            opt.step()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(STEPS):
                opt.step()
            step_ms = (time.perf_counter() - t0) / STEPS * 1e3
            state_bytes = sum(t.numel() * t.element_size() for s in opt.optim.state.values()
                              for t in s.values() if torch.is_tensor(t))
            dist.barrier()
            t0 = time.perf_counter()
            opt.consolidate_state_dict(to=0)
            consolidate_ms = (time.perf_counter() - t0) * 1e3
            if rank == 0:
                out.put("%s %s %.1f %.1f %.1f" % (model, "bucket_view" if bucket_view else "per_param", step_ms,
                                                  state_bytes / (1 << 20), consolidate_ms))
    dist.destroy_process_group()


if __name__ == "__main__":
    items, code = run_two_ranks(run)
    print("model config step_ms state_MiB_rank0 consolidate_ms")
    for line in items:
        print(line)
    sys.exit(code)
