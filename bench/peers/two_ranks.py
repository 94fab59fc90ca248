"""Runs fn(rank, port, queue) in spawned processes that rendezvous on a free loopback port;
returns what they put on the queue and the worst exit code. Shared by the PyTorch peer scripts."""
import queue
import socket

import torch.multiprocessing as mp


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
