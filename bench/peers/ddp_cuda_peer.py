#!/usr/bin/python3
"""PyTorch's rows of //ddp_hooks:ddp_cuda_benchmark: one GPU, an NCCL process group of world size 1
(on a FileStore), 8 x Linear(1792, 1792) with tanh (25.7M fp32 parameters), batch 256, on cuda:0.
    /usr/bin/python3 bench/peers/ddp_cuda_peer.py
Rows (each iteration followed by torch.cuda.synchronize(); WARMUP untimed, then the mean of STEPS):
  BM_CudaForwardBackward  zero_grad + forward + backward, no DDP (the floor)
  BM_CudaDdpIteration     the same through torch.nn.parallel.DistributedDataParallel (its built-in
                          all-reduce, bucket_cap_mb=25)
  BM_CudaDdpAdamStep      DDP iteration + torch.optim.Adam(fused=True) step
  BM_CudaDdpZeroStep      DDP iteration + torch.distributed.optim.ZeroRedundancyOptimizer(Adam,
                          fused=True) step
  BM_CudaDdpZeroOverlap   ZeroRedundancyOptimizer(overlap_with_ddp=True) with hook_with_zero_step
                          around allreduce_hook (PyTorch's own; its first iterations are its
                          warm-up, within WARMUP)
Prints "torch_version", then "<row>_ms <mean milliseconds per iteration>" and
"<row>_overhead_vs_fwd_bwd <row / BM_CudaForwardBackward>" (the dtrain rows' Time column and
counter), or "<row> error <why>"; "<row>_note ..." where fused=True had to be dropped. Without a
CUDA device it prints "skipped no CUDA device" and exits 0."""
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

LAYERS = 8
WIDTH = 1792
BATCH = 256
LR = 1e-4
WARMUP = int(os.environ.get("WARMUP", "5"))
STEPS = int(os.environ.get("STEPS", "30"))


def mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).cuda()


def ddp(model):
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=25)


def timed(iteration):
    """Mean seconds of STEPS calls, each followed by a device synchronisation, after WARMUP."""
    for _ in range(WARMUP):
        iteration()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        iteration()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / STEPS


def fwd_bwd(x, fused):
    model = mlp()

    def iteration():
        model.zero_grad()
        model(x).sum().backward()
    return timed(iteration)


def ddp_iteration(x, fused):
    model = ddp(mlp())

    def iteration():
        model.zero_grad()
        model(x).sum().backward()
    return timed(iteration)


def ddp_adam(x, fused):
    model = ddp(mlp())
    opt = torch.optim.Adam(model.parameters(), lr=LR, **({"fused": True} if fused else {}))

    def iteration():
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return timed(iteration)


def ddp_zero(x, fused):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = ddp(mlp())
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR,
                                   **({"fused": True} if fused else {}))

    def iteration():
        zero.zero_grad()
        model(x).sum().backward()
        zero.step()
    return timed(iteration)


def ddp_zero_overlap(x, fused):
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = ddp(mlp())
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True,
                                   lr=LR, **({"fused": True} if fused else {}))
    model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, zero))

    def iteration():
        zero.zero_grad()
        model(x).sum().backward()  # the hook steps; zero.step() is not called with overlap_with_ddp
    return timed(iteration)


ROWS = (("BM_CudaForwardBackward", fwd_bwd), ("BM_CudaDdpIteration", ddp_iteration),
        ("BM_CudaDdpAdamStep", ddp_adam), ("BM_CudaDdpZeroStep", ddp_zero),
        ("BM_CudaDdpZeroOverlap", ddp_zero_overlap))


def main():
    print("torch_version %s" % torch.__version__, flush=True)
    if not torch.cuda.is_available():
        print("skipped no CUDA device", flush=True)
        return
    torch.cuda.set_device(0)
    tmp = tempfile.mkdtemp(prefix="ddp_cuda_peer.")
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        x = torch.randn(BATCH, WIDTH, device="cuda")
        floor = None
        for name, row in ROWS:
            seconds = None
            for fused in (True, False):
                try:
                    seconds = row(x, fused)
                    break
                except Exception as e:  # noqa: BLE001 -- a row's failure is its line, not the run's end
                    why = (str(e).splitlines() or [type(e).__name__])[0][:100]
                    if fused and "fused" in str(e):
                        print("%s_note fused=True unsupported here (%s); running without it" % (name, why), flush=True)
                        continue
                    print("%s error %s" % (name, why), flush=True)
                    break
                finally:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            if seconds is None:
                continue
            if floor is None and row is fwd_bwd:
                floor = seconds
            print("%s_ms %.3f" % (name, seconds * 1e3), flush=True)
            if floor:
                print("%s_overhead_vs_fwd_bwd %.3f" % (name, seconds / floor), flush=True)
        dist.destroy_process_group()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
