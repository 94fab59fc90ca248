#!/usr/bin/python3
"""PyTorch's peer of //checkpoint:dcp_benchmark: dcp.save and dcp.async_save at world 2 (Gloo on
loopback), each rank holding half of every tensor (DTensor Shard(0), as a ZeRO/FSDP shard).

    /usr/bin/python3 bench/peers/dcp_pytorch.py MIB [REPEATS]
prints "sync_save_ms X", "async_blocked_ms Y" (until async_save returns) and "async_total_ms Z"
(until its future is done), with async_save's default stager (stages afresh each time), and
"async_cached_blocked_ms", "async_cached_total_ms" with one DefaultStager kept for the run (its
staging copies reused, as dtrain's AsyncDcpSaver): medians over REPEATS (default 5), rank 0's
clock, as the C++ side.
State: MIB MiB of float32 in tensors of 32 MiB at most; written under $DTRAIN_BENCH_DIR (default
/tmp/dtrain-bench)/dcp-pytorch-<n>, removed after."""
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def rank_main(rank, mib, repeats, root, store, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    per_tensor = min(mib, 32) << 18
    tensors = (mib << 18) // per_tensor
    state = {"optim.state.p%d.exp_avg" % i: distribute_tensor(torch.randn(per_tensor), mesh, [Shard(0)])
             for i in range(tensors)}
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    # Kept for the run: its StateDictStager maps each source storage to its staging copy and
    # reuses it (async_save's own default stager is made afresh for every call).
    cached = DefaultStager(StagingOptions(False, False, False, False))
    sync, blocked, total, cblocked, ctotal = [], [], [], [], []
    run = 0
    modes = ["sync", "async", "async_cached"]
    for rep in range(repeats):
        # A save right after another runs slower (its files being removed and written back):
        # the order rotates, as in the C++ side.
        for mode in modes[rep % 3:] + modes[:rep % 3]:
            path = os.path.join(root, "dcp-pytorch-%d" % run)
            run += 1
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                os.makedirs(path)
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "sync":
                dcp.save(state, checkpoint_id=path)
                sync.append((time.perf_counter() - t0) * 1e3)
            elif mode == "async":
                fut = dcp.async_save(state, checkpoint_id=path)
                blocked.append((time.perf_counter() - t0) * 1e3)
                fut.result()
                total.append((time.perf_counter() - t0) * 1e3)
            else:
                fut = dcp.async_save(state, checkpoint_id=path, async_stager=cached)
                cblocked.append((time.perf_counter() - t0) * 1e3)
                fut.result()
                ctotal.append((time.perf_counter() - t0) * 1e3)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    if rank == 0:
        with open(out, "w") as f:
            f.write("sync_save_ms %.1f\nasync_blocked_ms %.1f\nasync_total_ms %.1f\n"
                    "async_cached_blocked_ms %.1f\nasync_cached_total_ms %.1f\n" % (
                        statistics.median(sync), statistics.median(blocked), statistics.median(total),
                        statistics.median(cblocked), statistics.median(ctotal)))
    cached.close()
    dist.destroy_process_group()


def main():
    mib = int(sys.argv[1])
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    root = os.environ.get("DTRAIN_BENCH_DIR", "/tmp/dtrain-bench")
    os.makedirs(root, exist_ok=True)
    store = tempfile.mktemp(prefix="dcp_bench_store_")
    out = tempfile.mktemp(prefix="dcp_bench_out_")
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(mib, repeats, root, store, out), nprocs=2, join=True)
    sys.stdout.write(open(out).read())


if __name__ == "__main__":
    main()
