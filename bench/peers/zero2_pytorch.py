#!/usr/bin/python3
"""PyTorch's peers of //ddp_hooks:ddp_benchmark's BM_DDPZeroStep (DDP + ZeroRedundancyOptimizer,
and dtrain's ZeRO-2), world 2 (two processes, Gloo over loopback), the same model: 8 x
Linear(1024, 1024) + ReLU, batch 2 per rank, Adam(lr=1e-4), 4 MiB buckets.
    /usr/bin/python3 bench/peers/zero2_pytorch.py     # PyTorch 1.13 (host)
    DTRAIN_LIBTORCH=trixie ./bazelw --exec python3 bench/peers/zero2_pytorch.py   # PyTorch 2.6
Prints the mean iteration time (zero_grad + forward + backward + step) of DDP +
ZeroRedundancyOptimizer and of FSDP with ShardingStrategy.SHARD_GRAD_OP (PyTorch's ZeRO-2),
or the reason FSDP does not run here, and backward alone as a control."""
import sys

import torch
import torch.distributed as dist

from two_ranks import backward_ms, init_gloo, mlp, run_two_ranks, timed


def run(rank, port, q):
    init_gloo(rank, port)
    x = torch.randn(2, 1024)
    results = {"backward": backward_ms(x)}

    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = torch.nn.parallel.DistributedDataParallel(mlp(), gradient_as_bucket_view=True, bucket_cap_mb=4)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4,
                                   parameters_as_bucket_view=True)

    def ddp_zero():
        zero.zero_grad()
        model(x).sum().backward()
        zero.step()
    results["ddp_zero1"] = timed(ddp_zero)

    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        fsdp = FSDP(mlp(), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, device_id=torch.device("cpu"))
        opt = torch.optim.Adam(fsdp.parameters(), lr=1e-4)

        def fsdp_step():
            opt.zero_grad()
            fsdp(x).sum().backward()
            opt.step()
        results["fsdp_shard_grad_op"] = timed(fsdp_step)
    except Exception as e:  # noqa: BLE001 -- reported, not hidden
        results["fsdp_shard_grad_op"] = "does not run: %s: %s" % (type(e).__name__, str(e).splitlines()[0][:200])
    if rank == 0:
        q.put(results)
    dist.destroy_process_group()


if __name__ == "__main__":
    items, code = run_two_ranks(run)
    print("PyTorch %s" % torch.__version__)
    for k, v in sorted(items[0].items()):
        print("%s %s" % (k, "%.1f ms" % v if isinstance(v, float) else v))
    sys.exit(code)
