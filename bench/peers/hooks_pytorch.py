#!/usr/bin/python3
"""PyTorch's DDP communication hooks on //ddp_hooks:hooks_benchmark's gradients: 80 MiB of fp32
in transformer-like shapes (four 2048x2048, eight 1024x640, eight 2048) cut into 25 MiB buckets,
world 2 (two processes, Gloo over loopback). The hooks are called directly on a stand-in for
dist.GradBucket (same methods), so only the hook's own work is timed, as in the C++ benchmark.
    /usr/bin/python3 bench/peers/hooks_pytorch.py
Prints "<hook>_ms <mean ms per round of all buckets>" lines; a hook that fails prints
"<hook>_ms error <message>"."""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from two_ranks import run_two_ranks

STEPS = int(os.environ.get("STEPS", "5"))


class Bucket:
    """What the hooks use of dist.GradBucket."""

    def __init__(self, index, count, params):
        self._index, self._count, self._params = index, count, params
        self._buffer = torch.randn(sum(p.numel() for p in params))

    def index(self):
        return self._index

    def is_last(self):
        return self._index == self._count - 1

    def buffer(self):
        return self._buffer

    def set_buffer(self, buffer):
        self._buffer = buffer

    def parameters(self):
        return self._params

    def gradients(self):
        out, offset = [], 0
        for p in self._params:
            out.append(self._buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out


def make_buckets():
    params = ([torch.randn(2048, 2048) for _ in range(4)] + [torch.randn(1024, 640) for _ in range(8)] +
              [torch.randn(2048) for _ in range(8)])
    groups, current, size, cap = [], [], 0, 25 << 20
    for p in params:
        if current and size + 4 * p.numel() > cap:
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += 4 * p.numel()
    groups.append(current)
    return [Bucket(i, len(groups), g) for i, g in enumerate(groups)]


def run(rank, port, q):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=2)
    buckets = make_buckets()
    results = {}

    def psgd(r):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2)
        state.iter = 2  # compress from the first measured call, as the C++ benchmark
        return state, powerSGD_hook.powerSGD_hook

    for name, (state, hook) in (("allreduce", (None, default_hooks.allreduce_hook)),
                                ("fp16", (None, default_hooks.fp16_compress_hook)),
                                ("powersgd_rank1", psgd(1)),
                                ("powersgd_rank4", psgd(4)),
                                # Last: Gloo cannot all-reduce bfloat16 in PyTorch 1.13, and the
                                # failure leaves the group unusable.
                                ("bf16", (None, default_hooks.bf16_compress_hook))):
        def one_round():
            if state is None:
                for f in [hook(state, b) for b in buckets]:
                    f.wait()
                return
            # PowerSGD issues its later all-reduces from future callbacks; with several buckets
            # in flight on Gloo those interleave differently on the two ranks and the job hangs
            # (seen here with PyTorch 1.13), so its buckets go one at a time.
            for b in buckets:
                hook(state, b).wait()
        try:
            print("rank", rank, name, file=sys.stderr, flush=True) if os.environ.get("VERBOSE") else None
            one_round()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(STEPS):
                one_round()
            results[name] = "%.1f" % ((time.perf_counter() - t0) / STEPS * 1e3)
        except Exception as e:  # noqa: BLE001 -- reported, not hidden
            print("rank", rank, name, "failed:", e, file=sys.stderr, flush=True) if os.environ.get("VERBOSE") else None
            results[name] = "error " + str(e).splitlines()[0][:120]
            break
    if rank == 0:
        q.put(results)
        q.close()
        q.join_thread()
    # Skip the group's teardown: after a failed collective Gloo may wait forever for its peer.
    os._exit(0)


if __name__ == "__main__":
    items, code = run_two_ranks(run)
    for k, v in items[0].items():
        print("%s_ms %s" % (k, v))
    sys.exit(code)
