#!/usr/bin/python3
"""PyTorch's own optimizers on CUDA, on //optim/functional:optimizers_cuda_benchmark's shapes: 16M fp32
parameters as 64 tensors and as one tensor; torch.optim.Adam, AdamW, SGD and SGD with momentum,
each with fused=True and with foreach=True (PyTorch's default on CUDA). Each step is followed by
torch.cuda.synchronize(), as the dtrain rows are, and the floor is measured the same way: the best
of 20 device-to-device copies of half the bytes the step reads and writes.
    /usr/bin/python3 bench/peers/adam_cuda_peer.py
Prints "torch_version", "copy_GBps <bytes read + written per second / 1e9>", then for each row
"<optimizer>_<tensors>_<impl>_us <mean microseconds per step>" and
"<optimizer>_<tensors>_<impl>_ratio_to_floor <step time / floor>" (the dtrain rows' units: Google
Benchmark's us and its ratio_to_floor counter), or "<...> error <why>" where this PyTorch lacks the
implementation. Without a CUDA device it prints "skipped no CUDA device" and exits 0."""
import os
import time

import torch

N = 16 << 20
STEPS = int(os.environ.get("STEPS", "20"))
# name, constructor, bytes one step moves per parameter (fp32 arrays read + written)
OPTIMIZERS = (("sgd", lambda ps, **kw: torch.optim.SGD(ps, lr=1e-3, **kw), 4 * 3),
              ("sgd_momentum", lambda ps, **kw: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, **kw), 4 * 5),
              ("adam", lambda ps, **kw: torch.optim.Adam(ps, lr=1e-3, **kw), 4 * 7),
              ("adamw", lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, **kw), 4 * 7))
IMPLS = (("fused", {"fused": True}), ("foreach", {"foreach": True}))


def floor_seconds(nbytes, cache={}):
    if nbytes not in cache:
        src = torch.randn(nbytes // 2 // 4, device="cuda")
        dst = torch.empty_like(src)
        dst.copy_(src)
        torch.cuda.synchronize()
        best = 1e30
        for _ in range(20):
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        cache[nbytes] = best
    return cache[nbytes]


def timed(opt):
    opt.step()  # state allocation
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        opt.step()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / STEPS


def main():
    print("torch_version %s" % torch.__version__, flush=True)
    if not torch.cuda.is_available():
        print("skipped no CUDA device", flush=True)
        return
    print("copy_GBps %.1f" % (4 * 7 * N / floor_seconds(4 * 7 * N) / 1e9), flush=True)
    for tensors in (64, 1):
        for name, make, per_param in OPTIMIZERS:
            for impl, kwargs in IMPLS:
                key = "%s_%d_%s" % (name, tensors, impl)
                params = [torch.nn.Parameter(torch.randn(N // tensors, device="cuda")) for _ in range(tensors)]
                for p in params:
                    p.grad = torch.randn_like(p)
                try:
                    seconds = timed(make(params, **kwargs))
                except Exception as e:  # noqa: BLE001 -- any failure of an implementation is a row's note
                    print("%s error %s" % (key, str(e).splitlines()[0][:80]), flush=True)
                    continue
                finally:
                    del params
                print("%s_us %.1f" % (key, seconds * 1e6), flush=True)
                print("%s_ratio_to_floor %.2f" % (key, seconds / floor_seconds(per_param * N)), flush=True)


if __name__ == "__main__":
    main()
