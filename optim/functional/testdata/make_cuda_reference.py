#!/usr/bin/python3
"""PyTorch as the oracle on CUDA: writes the parameters after each of 10 steps of torch.optim's
Adam, AdamW and SGD with fused=True and Adagrad with foreach=True (the paths dtrain's CUDA default
takes) on the GPU, for
//optim/functional:optimizers_cuda_pytorch_test to compare step for step. Run on the GPU machine by
bench/gpu/run_on_gpu (its PyTorch is the oracle):
    python3 make_cuda_reference.py OUT.pt
Parameters and gradients come from formulas, computed on the CPU in float32 and then moved, so
the C++ side computes the same bits. A case this PyTorch cannot run is stored as its error string."""
import math
import sys

import torch

SHAPES = [(37,), (8, 33), (3, 4, 5), (1,), (70001,)]
STEPS = 10
CASES = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01, amsgrad=True, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3, fused=True),
    # torch.optim.Adagrad refuses fused=True on CUDA: its CUDA default, foreach, is the oracle.
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, weight_decay=1e-3, foreach=True),
}


def initial(i, shape):
    n = math.prod(shape)
    return torch.sin(torch.arange(n, dtype=torch.float32) * 0.37 + i).view(shape)


def gradient(i, step, shape):
    n = math.prod(shape)
    return torch.cos(torch.arange(n, dtype=torch.float32) * 0.11 + (step * 1.3 + i)).view(shape)


def run(make):
    params = [torch.nn.Parameter(initial(i, s).cuda()) for i, s in enumerate(SHAPES)]
    opt = make(params)
    steps = []
    for step in range(STEPS):
        for i, (p, s) in enumerate(zip(params, SHAPES)):
            p.grad = gradient(i, step, s).cuda()
        opt.step()
        steps.append([p.detach().cpu().clone() for p in params])
    return steps


def main():
    out = {"torch_version": str(torch.__version__)}
    for name, make in CASES.items():
        try:
            out[name] = run(make)
        except Exception as e:  # noqa: BLE001 -- recorded for the test to report
            out[name] = "error: " + str(e).splitlines()[0][:200]
    torch.save(out, sys.argv[1])


if __name__ == "__main__":
    main()
