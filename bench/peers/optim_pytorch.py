#!/usr/bin/python3
"""PyTorch's own optimizers on //optim/functional:optimizers_benchmark's shapes: 16M fp32 parameters as one
tensor and as 64 tensors, PyTorch's default thread settings, each implementation PyTorch has on
CPU: the default (for-loop), foreach=True, fused=True (PyTorch 2.4+ on CPU) and a torch.compile'd
step (PyTorch's recommended fast path; compiled by the untimed first two steps).
    /usr/bin/python3 bench/peers/optim_pytorch.py
Prints "<optimizer>_<tensors>_<impl>_ms <mean ms per step>" lines, or "... error <why>" where this
PyTorch lacks the implementation; "<optimizer>_<tensors>_ms" is the default one (older readers)."""
import os
import time

import torch

N = 16 << 20
STEPS = int(os.environ.get("STEPS", "10"))
OPTIMIZERS = (("adam", lambda ps, **kw: torch.optim.Adam(ps, lr=1e-3, **kw)),
              ("adamw", lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, **kw)),
              ("sgd_momentum", lambda ps, **kw: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, **kw)),
              ("adagrad", lambda ps, **kw: torch.optim.Adagrad(ps, lr=1e-3, **kw)))
IMPLS = (("default", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True}),
         ("compiled", {"foreach": False}))


def timed(opt, compiled=False):
    step = opt.step
    if compiled:
        step = torch.compile(opt.step)
        step()  # the first step makes the state (a second graph), the next ones reuse it
    step()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - t0) / STEPS * 1e3


def main():
    print("torch_version %s" % torch.__version__, flush=True)
    for tensors in (64, 1):
        params = [torch.nn.Parameter(torch.full((N // tensors,), 0.5)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.full_like(p, 0.01)
        for name, make in OPTIMIZERS:
            for impl, kwargs in IMPLS:
                key = "%s_%d_%s_ms" % (name, tensors, impl)
                try:
                    ms = timed(make(params, **kwargs), compiled=impl == "compiled")
                except Exception as e:  # noqa: BLE001 -- any failure of an implementation is a row's note
                    print("%s error %s" % (key, str(e).splitlines()[0][:80]), flush=True)
                    continue
                print("%s %.1f" % (key, ms), flush=True)
                if impl == "default":
                    print("%s_%d_ms %.1f" % (name, tensors, ms), flush=True)


if __name__ == "__main__":
    main()
