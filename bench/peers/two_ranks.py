"""Runs fn(rank, port, queue) in spawned processes that rendezvous on a free loopback port;
returns what they put on the queue and the worst exit code. Shared by the PyTorch peer scripts,
with //ddp_hooks:ddp_benchmark's model and a timing loop for the DDP ones."""
import os
import queue
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = int(os.environ.get("STEPS", "30"))


def mlp():
    """8 x Linear(1024, 1024) + ReLU: //ddp_hooks:ddp_benchmark's model (8.4M parameters)."""
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def init_gloo(rank, port):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=2)


def backward_ms(x):
    """The control row: forward + backward of mlp() alone, no communication."""
    plain = mlp()

    def backward_only():
        plain.zero_grad()
        plain(x).sum().backward()
    return timed(backward_only)


def timed(fn):
    """Mean milliseconds of fn() over STEPS calls, after one warm-up and a barrier."""
    fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        fn()
    return (time.perf_counter() - t0) / STEPS * 1e3


def run_ranks(fn, world_size):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(r, port, q)) for r in range(world_size)]
    for p in procs:
        p.start()
    # Read while they run: a child blocks on exit until what it queued has been consumed.
    items = []
    while any(p.is_alive() for p in procs):
        try:
            items.append(q.get(timeout=0.5))
        except queue.Empty:
            pass
    for p in procs:
        p.join()
    while not q.empty():
        items.append(q.get())
    return items, max(p.exitcode for p in procs)


def run_two_ranks(fn):
    return run_ranks(fn, 2)
