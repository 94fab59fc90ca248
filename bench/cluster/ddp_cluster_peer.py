#!/usr/bin/python3
"""PyTorch's side of bench/cluster/ddp_cluster_bench.cc, row for row: one rank per host of a
comm/testing/netns_cluster.py cluster, Gloo over the shaped link, joined from torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GLOO_SOCKET_IFNAME).

    ddp_cluster_peer.py [--modes=backward,allreduce,ddp,...] [--iters=10] [--batch=2]

Rank 0 prints one JSON object per row: impl "pytorch", mode, ms per iteration, tx_bytes per
iteration sent by this host (and "loss" for the localsgd rows). zero2 has no PyTorch counterpart
(PyTorch's ZeRO is stage 1) and is skipped."""
import argparse
import datetime
import json
import os
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.model_averaging import averagers
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer


def mlp():
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def tx_bytes():
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
    return 0


def cpu_ms():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return (u.ru_utime + u.ru_stime) * 1e3


CPU_MS = {}  # the last timed() call's CPU ms per iteration (every thread of this process)


def timed(iters, iteration):
    for _ in range(3):
        iteration()
    dist.barrier()
    tx0, cpu0, start = tx_bytes(), cpu_ms(), time.perf_counter()
    for _ in range(iters):
        iteration()
    CPU_MS["last"] = (cpu_ms() - cpu0) / iters
    dist.barrier()
    return (time.perf_counter() - start) * 1e3 / iters, (tx_bytes() - tx0) // iters


def run_local_sgd(mode, iters, batch, ranks_per_node):
    """The localsgd rows of ddp_cluster_bench.cc: ms per step, bytes, loss after 3 + iters steps."""
    torch.manual_seed(1)
    teacher = mlp()
    torch.manual_seed(0)
    model = mlp()

    def data(seed, rows):
        torch.manual_seed(seed)
        x = torch.randn(rows, 1024)
        with torch.no_grad():
            return x, teacher(x) * 100

    def loss_of(xy, net):
        return torch.nn.functional.mse_loss(net(xy[0]) * 100, xy[1])
    net = model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if mode == "localsgd_ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    elif mode == "localsgd_periodic":
        opt = PostLocalSGDOptimizer(opt, averagers.PeriodicModelAverager(period=2, warmup_steps=0))
    else:
        from collections import OrderedDict
        opt = PostLocalSGDOptimizer(opt, HierarchicalModelAverager(
            OrderedDict([(2, ranks_per_node), (8, dist.get_world_size())]), warmup_steps=0))
    count = [0]

    def step():
        xy = data(1000 + 7919 * count[0] + dist.get_rank(), batch)
        count[0] += 1
        opt.zero_grad()
        loss_of(xy, net).backward()
        opt.step()
    ms, tx = timed(iters, step)
    with torch.no_grad():
        return ms, tx, loss_of(data(424242, 64), model).item()


def run_mode(mode, iters, batch):
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(batch, 1024) * (dist.get_rank() + 1)
    if mode == "backward":
        def step():
            model.zero_grad()
            model(x).sum().backward()
        return timed(iters, step)
    if mode == "allreduce":
        grads = [torch.randn_like(p) for p in model.parameters()]
        # DDP's buckets: 25 MiB, flattened, one all-reduce each.
        buckets, cur, size = [], [], 0
        for g in reversed(grads):
            cur.append(g)
            size += g.numel() * 4
            if size >= 25 << 20:
                buckets.append(torch.cat([t.flatten() for t in cur])); cur, size = [], 0
        if cur:
            buckets.append(torch.cat([t.flatten() for t in cur]))
        return timed(iters, lambda: [w.wait() for w in [dist.all_reduce(b, async_op=True) for b in buckets]])
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    if mode == "zero1":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4,
                                      parameters_as_bucket_view=True)

        def step():
            opt.zero_grad()
            ddp(x).sum().backward()
            opt.step()
        return timed(iters, step)
    if mode in ("fp16", "bf16"):
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook if mode == "fp16"
                               else default_hooks.bf16_compress_hook)
    elif mode.startswith("powersgd"):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(mode[-1]),
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def step():
        model.zero_grad()
        ddp(x).sum().backward()
    return timed(iters, step)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="backward,allreduce,ddp,fp16,bf16,powersgd1,powersgd4,zero1")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--ranks_per_node", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core per host, as dtrain's side
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    for mode in args.modes.split(","):
        if mode == "zero2":
            continue
        if mode in ("fp16", "bf16"):
            # Some Gloo builds (Debian's 2.14) cannot all-reduce half types: PyTorch's compression
            # hooks then fail ("Invalid scalar type"); every rank finds out alike, before sending.
            try:
                dist.all_reduce(torch.zeros(1, dtype=torch.float16 if mode == "fp16" else torch.bfloat16))
            except RuntimeError as e:
                if dist.get_rank() == 0:
                    print(json.dumps({"impl": "pytorch", "mode": mode, "world": dist.get_world_size(),
                                      "error": str(e).splitlines()[0][:80]}), flush=True)
                continue
        row = {"impl": "pytorch", "mode": mode, "world": dist.get_world_size()}
        if mode.startswith("localsgd_"):
            ms, tx, row["loss"] = run_local_sgd(mode, args.iters, args.batch, args.ranks_per_node)
        else:
            ms, tx = run_mode(mode, args.iters, args.batch)
        row.update({"ms": round(ms, 2), "cpu_ms": round(CPU_MS["last"], 2), "tx_bytes": tx})
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
