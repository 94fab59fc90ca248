"""Runs fn(rank, port, queue) in two spawned processes that rendezvous on a free loopback port;
returns what they put on the queue and the worst exit code. Shared by the PyTorch peer scripts."""
import socket

import torch.multiprocessing as mp


def run_two_ranks(fn):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    items = []
    while not q.empty():
        items.append(q.get())
    return items, max(p.exitcode for p in procs)
