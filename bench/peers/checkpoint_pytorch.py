#!/usr/bin/python3
"""torch.load of a 160 MiB Python-written Adam state dict (20M fp32 parameters in 20 tensors:
exp_avg + exp_avg_sq, as //checkpoint:checkpoint_benchmark's BM_LoadPythonWritten reads).
    /usr/bin/python3 bench/peers/checkpoint_pytorch.py            # prints "load_160mib_adam_ms <ms>"
    /usr/bin/python3 bench/peers/checkpoint_pytorch.py write PATH # only writes the file
torch.load runs with weights_only=True on PyTorch 2.x (its default) and False on 1.13 (whose
weights-only loader cannot read floats). The file is written once per PyTorch version under
$DTRAIN_BENCH_DIR (default /tmp/dtrain-bench)."""
import os
import sys
import time

import torch

STEPS = int(os.environ.get("STEPS", "5"))
TENSORS, PER_TENSOR = 20, 1 << 20


def write(path):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(PER_TENSOR)) for _ in range(TENSORS)]
    opt = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(PER_TENSOR, generator=g)
    opt.step()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(opt.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write(sys.argv[2])
        return
    path = os.path.join(os.environ.get("DTRAIN_BENCH_DIR", "/tmp/dtrain-bench"), "python_adam_%s.pt" % torch.__version__.split("+")[0])
    if not os.path.exists(path):
        write(path)
    weights_only = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 0)
    torch.load(path, weights_only=weights_only)  # warm the page cache, as the C++ side does
    t0 = time.perf_counter()
    for _ in range(STEPS):
        torch.load(path, weights_only=weights_only)
    print("load_160mib_adam_ms %.2f" % ((time.perf_counter() - t0) / STEPS * 1e3))


if __name__ == "__main__":
    main()
