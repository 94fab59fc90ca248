#!/usr/bin/python3
"""torchft's side of bench/cluster/lm_cluster_bench.cc's diloco and streaming rows: one rank of
bench/lm's character GPT (bench/lm/lm_peer.py, its PyTorch twin) trained with torchft's DiLoCo
(torchft.local_sgd.DiLoCo, its Streaming DiLoCo with more than one fragment) across the hosts of a
comm/testing/netns_cluster.py cluster: one replica group (one rank) per host, each with its own
torchft Manager and ProcessGroupGloo over the shaped link, and a torchft Lighthouse that rank 0
serves (on MASTER_ADDR, port MASTER_PORT + 1) for every replica to form its quorums with.

    ./bazelw --exec bench/cluster/lm_run --torchft [--rates=...] [-- BENCH FLAGS...]   # the rows
    # one rank, as lm_run starts it on every host (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set):
    PYTHONPATH=/opt/torchft python3 bench/cluster/lm_torchft.py --modes=diloco@100,streaming@100

torchft (PyPI `torchft`, 0.2.0) is not a Debian package: lm_run looks for it on PYTHONPATH or in
/opt/torchft of the root (`pip install --no-deps --target /opt/torchft torchft==0.2.0` and its
opentelemetry dependencies). The flags and defaults are lm_cluster_bench's, and so is the schedule:
the same initial weights on every rank (seed 0), step s of rank r takes the training batch of
(seed 0, stream 0, s * world + r + 1), AdamW inside (lr with linear warm-up, weight decay 0.01),
Nesterov SGD outside (--outer_lr 0.7, --outer_momentum 0.9), the parameters cut into --fragments
contiguous fragments of about equal element counts as dtrain cuts them, each with its own outer
optimizer. --outer_compression other than "none" turns on torchft's should_quantize (its fp8
all-reduce), which torchft takes only where Triton imports, and which then needs a GPU: the row
says whether torchft took that path ("quantized") and how many outer steps committed
("outer_steps").

Rank 0 prints one JSON object per mode, the shape of lm_cluster_bench's with "impl": "torchft":
ms per step (every step timed, syncs and quorums included; the first quorum, which connects the
Gloo group, runs before the first step, as dtrain's group is made before its), tx_bytes per step and
peak_tx_bytes by rank 0's host on its link (the Lighthouse's replies to the other hosts included),
total_tx_bytes, train_loss (mean of rank 0's last 10), val_loss, curve."""
import argparse
import datetime
import importlib.metadata
import json
import os
import sys
import time
from importlib.machinery import SourceFileLoader

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
lm_peer = SourceFileLoader("lm_peer", os.path.join(ROOT, "bench", "lm", "lm_peer.py")).load_module()

HEARTBEAT_TIMEOUT_MS = 1000  # the Lighthouse drops a replica silent this long (a finished row's)


def tx_bytes():
    """Bytes this namespace's eth0 (the shaped link) has sent: bench/cluster/link_stats.cc's."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if "eth0" in name:
                return int(rest.split()[8])
    return 0


def patch_torchft():
    """Two workarounds, both in this process only. (1) Debian's PyTorch is built without libuv and
    torch.distributed.TCPStore asks for it by default ("use_libuv was requested but PyTorch was
    built without libuv support"; USE_LIBUV=0 reaches only init_process_group's stores): torchft's
    Manager and ProcessGroupGloo make theirs without libuv. (2) torchft 0.2.0 has wheels for
    CPython 3.9-3.13 only; the cp313 extension loads into 3.14, but wherever pyo3 reads a tuple
    it reads 3.13's layout (3.14's tuples have a new ob_hash field) and dies with SIGSEGV: a
    constructor's positional arguments, a method's keyword names. Constructors with keywords (a
    dict) and methods with positional arguments (a C array) work: the Manager's ManagerClient is
    called so."""
    import functools
    from torchft import _torchft, manager, process_group
    store = functools.partial(torch.distributed.TCPStore, use_libuv=False)
    manager.TCPStore = process_group.TCPStore = store

    class ManagerClient:
        def __init__(self, addr, connect_timeout):
            self._c = _torchft.ManagerClient(addr=addr, connect_timeout=connect_timeout)

        def _quorum(self, group_rank, step, checkpoint_metadata, shrink_only, init_sync,
                    commit_failures, timeout):
            return self._c._quorum(group_rank, step, checkpoint_metadata, shrink_only, init_sync,
                                   commit_failures, timeout)

        def _checkpoint_metadata(self, rank, timeout):
            return self._c._checkpoint_metadata(rank, timeout)

        def should_commit(self, group_rank, step, should_commit, timeout):
            return self._c.should_commit(group_rank, step, should_commit, timeout)
    manager.ManagerClient = ManagerClient


def split_fragments(params, fragments):
    """optim/diloco.cc's split_fragments: contiguous fragments of about equal element counts."""
    n = len(params)
    before = [0]
    for p in params:
        before.append(before[-1] + p.numel())
    start = [0] * (fragments + 1)
    start[-1] = n
    for f in range(1, fragments):
        s = 0
        while s < n and before[s] * fragments < f * before[n]:
            s += 1
        start[f] = min(max(s, start[f - 1] + 1), n - (fragments - f))
    return [list(range(start[f], start[f + 1])) for f in range(fragments)]


def fragment_modules(model, fragments):
    """The model's parameters as `fragments` modules (torchft's model_fragments), sharing them."""
    named = list(model.named_parameters())
    out = []
    for idx in split_fragments([p for _, p in named], fragments):
        m = torch.nn.Module()
        for i in idx:
            m.register_parameter(named[i][0].replace(".", "_"), named[i][1])
        out.append(m)
    return out


def parse_row(row, args):
    mode, _, every = row.partition("@")
    if mode not in ("diloco", "streaming"):
        raise SystemExit("lm_torchft: mode '%s': torchft's rows are diloco and streaming" % mode)
    if every and (not every.isdigit() or int(every) < 1):
        raise SystemExit("lm_torchft: '%s': what follows '@' must be a positive step count" % row)
    return mode, int(every) if every else args.sync_every


def run_mode(row, args, rank, world, train, val, lighthouse):
    """One row: a fresh model, Manager and DiLoCo; rank 0's measurements."""
    from torchft import Manager, ProcessGroupGloo
    from torchft import manager as ft_manager
    from torchft.local_sgd import DiLoCo

    mode, h = parse_row(row, args)
    fragments = args.fragments if mode == "streaming" else 1
    delay = args.fragment_sync_delay if mode == "streaming" else 0
    quantize = mode == "streaming" and args.outer_compression != "none"
    model = lm_peer.CharLM(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                           context=args.context, seed=0)  # the same weights on every rank
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    parts = fragment_modules(model, fragments)
    outer = [torch.optim.SGD(m.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True)
             for m in parts]

    addr = os.environ.get("DTRAIN_HOST_ADDR", "127.0.0.1")
    store = torch.distributed.TCPStore(addr, 0, is_master=True, wait_for_workers=False, use_libuv=False)
    timeout = datetime.timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        min_replica_size=world, use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
        connect_timeout=timeout, rank=0, world_size=1, store_addr=addr, store_port=store.port,
        lighthouse_addr=lighthouse, replica_id="lm_%d" % rank, hostname=addr,
        init_sync=False)  # every rank starts from the same weights: nothing to heal at step 0
    # The first quorum connects the Gloo group (dtrain's group exists before its first step too);
    # a one-element all-reduce then lines the ranks up, as lm_cluster_bench's barrier.
    manager.start_quorum()
    manager.wait_quorum()
    manager.allreduce(torch.zeros(1)).wait()

    losses, curve, ms, total, peak = [], [], 0.0, 0, 0
    with DiLoCo(manager, parts, inner, outer if fragments > 1 else outer[0], sync_every=h,
                should_quantize=quantize, fragment_sync_delay=delay):
        for s in range(1, args.steps + 1):
            t0, tx0 = time.perf_counter(), tx_bytes()
            x, y = lm_peer.sample_batch(train, args.batch_size, args.context, 0, lm_peer.TRAIN_STREAM,
                                        (s - 1) * world + rank + 1)
            for group in inner.param_groups:
                group["lr"] = args.lr * min(1.0, s / args.warmup) if args.warmup > 0 else args.lr
            inner.zero_grad()
            loss = model.loss(x, y)
            loss.backward()
            inner.step()  # DiLoCo's hook syncs at the end of a round
            losses.append(loss.item())
            sent = tx_bytes() - tx0
            peak, total = max(peak, sent), total + sent
            ms += (time.perf_counter() - t0) * 1e3
            if s % args.eval_every == 0 or s == args.steps:
                curve.append([s, round(lm_peer.validation_loss(model, val, args), 6)])
    manager.allreduce(torch.zeros(1)).wait()
    committed = manager.current_step()
    manager.shutdown(wait=False)
    tail = losses[-min(10, len(losses)):]
    return {"impl": "torchft", "torchft": importlib.metadata.version("torchft"), "mode": row, "world": world,
            "params": sum(p.numel() for p in model.parameters()), "ms": round(ms / args.steps, 2),
            "tx_bytes": total // args.steps, "peak_tx_bytes": peak, "total_tx_bytes": total,
            "train_loss": round(sum(tail) / len(tail), 6), "val_loss": curve[-1][1], "curve": curve,
            "outer_steps": committed, "should_quantize": quantize,
            "quantized": quantize and ft_manager.IS_TRITON_AVAILABLE}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="diloco,streaming")
    ap.add_argument("--text", default="/usr/share/common-licenses")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--sync_every", type=int, default=100)
    ap.add_argument("--localsgd_period", type=int, default=8, help="lm_cluster_bench's; unused")
    ap.add_argument("--outer_lr", type=float, default=0.7)
    ap.add_argument("--outer_momentum", type=float, default=0.9)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--fragment_sync_delay", type=int, default=5)
    ap.add_argument("--outer_compression", default="4bit",
                    help="other than none: torchft's should_quantize (fp8, where Triton imports)")
    ap.add_argument("--eval_every", type=int, default=50)
    ap.add_argument("--eval_batches", type=int, default=4)
    ap.add_argument("--d_model", type=int, default=64)
    ap.add_argument("--n_layers", type=int, default=2)
    ap.add_argument("--n_heads", type=int, default=2)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--timeout", type=int, default=300, help="seconds: quorums, collectives")
    args = ap.parse_args()
    args.seed = 0  # lm_peer.validation_loss's batches: lm_cluster_bench's (seed 0)
    torch.set_num_threads(1)  # one core per host, as lm_cluster_bench
    patch_torchft()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    lighthouse_addr = "%s:%d" % (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1)
    rows = [r for r in args.modes.split(",") if r]
    for r in rows:
        parse_row(r, args)
    server = None
    if rank == 0:
        from torchft.coordination import LighthouseServer
        server = LighthouseServer(bind="[::]:%d" % (int(os.environ["MASTER_PORT"]) + 1),
                                  min_replicas=world, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    _, _, train, val = lm_peer.load_text([e for e in args.text.split(",") if e])
    for i, row in enumerate(rows):
        if i:  # the last row's replicas must have left the Lighthouse before the next quorum
            time.sleep(2 * HEARTBEAT_TIMEOUT_MS / 1e3)
        r = run_mode(row, args, rank, world, train, val, "http://" + lighthouse_addr)
        if rank == 0:
            print(json.dumps(r), flush=True)
    if server is not None:
        time.sleep(1)  # the others' last RPCs
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
