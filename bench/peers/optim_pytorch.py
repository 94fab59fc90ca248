#!/usr/bin/python3
"""PyTorch's own optimizers on //optim:functional_benchmark's shapes: 16M fp32 parameters as one
tensor and as 64 tensors, PyTorch's default thread settings.
    /usr/bin/python3 bench/peers/optim_pytorch.py
Prints "<optimizer>_<tensors>_ms <mean ms per step>" lines."""
import os
import time

import torch

N = 16 << 20
STEPS = int(os.environ.get("STEPS", "10"))


def timed(opt):
    opt.step()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        opt.step()
    return (time.perf_counter() - t0) / STEPS * 1e3


def main():
    for tensors in (64, 1):
        params = [torch.nn.Parameter(torch.full((N // tensors,), 0.5)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.full_like(p, 0.01)
        for name, make in (("adam", lambda: torch.optim.Adam(params, lr=1e-3)),
                           ("adamw", lambda: torch.optim.AdamW(params, lr=1e-3)),
                           ("sgd_momentum", lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9))):
            print("%s_%d_ms %.1f" % (name, tensors, timed(make())), flush=True)


if __name__ == "__main__":
    main()
