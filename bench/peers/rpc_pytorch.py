#!/usr/bin/python3
"""PyTorch's RPC on //rpc:rpc_benchmark's shapes: a trainer and two owners (three processes,
TensorPipe over loopback). Rows: the round trip of an empty rpc_sync, and the step of
torch.distributed.optim.DistributedOptimizer (Adam) over 2 owners x 100 parameters of 1024
floats, gradients already in the distributed autograd context.
    /usr/bin/python3 bench/peers/rpc_pytorch.py
Prints "empty_call_us <us>" and "dist_optim_step_ms <ms>"."""
import os
import sys
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer

from two_ranks import run_ranks

STEPS = int(os.environ.get("STEPS", "200"))


def noop():
    return None


def make_param():
    return torch.zeros(1024, requires_grad=True)


def run(rank, port, q):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    names = ["trainer", "ps1", "ps2"]
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, _transports=["uv"], _channels=["basic"])
    rpc.init_rpc(names[rank], rank=rank, world_size=3, rpc_backend_options=opts)
    if rank == 0:
        rpc.rpc_sync("ps1", noop)
        t0 = time.perf_counter()
        for _ in range(STEPS):
            rpc.rpc_sync("ps1", noop)
        empty_us = (time.perf_counter() - t0) / STEPS * 1e6
        rrefs = [rpc.remote(owner, make_param) for owner in ("ps1", "ps2") for _ in range(100)]
        opt = DistributedOptimizer(torch.optim.Adam, rrefs, lr=1e-3)
        with dist_autograd.context() as cid:
            loss = sum((r.to_here() * 0.01).sum() for r in rrefs)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
            t0 = time.perf_counter()
            for _ in range(STEPS):
                opt.step(cid)
            step_ms = (time.perf_counter() - t0) / STEPS * 1e3
        q.put({"empty_call_us": "%.1f" % empty_us, "dist_optim_step_ms": "%.3f" % step_ms})
    rpc.shutdown()


if __name__ == "__main__":
    items, code = run_ranks(run, 3)
    for k, v in items[0].items():
        print(k, v)
    sys.exit(code)
