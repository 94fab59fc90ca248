#!/usr/bin/env python3
"""torchao beside //optim/functional:state_precision_benchmark: AdamW steps on the same shapes (16M
float32 parameters as 64 tensors and as 1 tensor), the same hyper-parameters (lr 1e-3, betas 0.9
and 0.999, eps 1e-8, weight decay 1e-2) and the same kind of gradient (one standard normal
gradient per tensor, drawn once and reused every step), in one process, every row's step taken in
turn in each round (each round starting one row later) so that drift hits all rows alike:

    aten_fused     torch.optim.AdamW(fused=True): at::_fused_adamw_, the C++ benchmark's ATen row
                   and the control that both processes are normalised by
    ao_8bit        torchao.optim.AdamW8bit on the float32 parameters (block_size 256)
    ao_bf16_sr     torchao.optim._AdamW(bf16_stochastic_round=True) on bfloat16 copies of the
                   parameters with bfloat16 gradients (the rounding only applies to bfloat16
                   parameters)
    ao_fp32        torchao.optim._AdamW on the float32 parameters: the same compiled step with
                   float32 state (what torch.compile makes of the math, without quantization)

    ./bazelw --exec env PYTHONPATH=/opt/torchao /usr/bin/python3 bench/peers/state_precision_peer.py
    ./bazelw --exec env PYTHONPATH=/opt/torchao /usr/bin/python3 bench/peers/state_precision_peer.py \
        --tensors=1 --rounds=5 --rows=aten_fused,ao_8bit

torchao compiles its per-tensor step with torch.compile(fullgraph=True, dynamic=False) on the
first call for each shape: the first step of each torchao row is timed apart (first_step_s,
compile included), then --warmup more steps, then --rounds timed rounds. --threads defaults to
ATen's default, which the C++ benchmark runs with (it sets none). The header names the vector
ISA Inductor compiles for (INVALID_VEC_ISA: scalar loops). Prints a table per layout, then
one JSON object per row ("json {...}") with mean and median ms, the ratio of the means to
aten_fused's, and the parameter, gradient and state dtypes read back from the optimizer's state.
Without torchao the torchao rows print "<row> skipped <why>" and only the control runs.

A setting for Debian's PyTorch (the sid root's python3-torch 2.14.1+dfsg-1): before torch is
imported, the script loads SLEEF (libsleef.so.3) with RTLD_GLOBAL and puts it on LD_PRELOAD for
its child processes (unless --no_sleef_global is given). Inductor's C++ kernels call SLEEF
(Sleef_expf8_u10, ...) through ATen's vec headers and are linked with -ltorch -ltorch_cpu
-ltorch_python -lgomp, no -lsleef: Inductor counts on libtorch_cpu to carry SLEEF's symbols (its
Note [Checking for Vectorized Support in Inductor]). Debian's libtorch_cpu takes them from the
shared libsleef.so.3, and Debian's g++ 16 links with --as-needed, so a kernel that uses no torch
symbol records no libtorch dependency (NEEDED: libstdc++ only) and its dlopen fails with
"undefined symbol: Sleef_expf8_u10" (linked with -Wl,--no-as-needed or -lsleef it loads);
`import torch` loads libsleef.so.3 RTLD_LOCAL, which does not help. Inductor's ISA check
(pick_vec_isa) compiles a probe with each ISA's flags and dlopens it in a child Python: it fails
so on every ISA, pick_vec_isa() returns INVALID_VEC_ISA and torch.compile generates scalar loops.
With SLEEF global here and preloaded in the children (the probe, Inductor's compile workers),
pick_vec_isa() reads avx512 avx512_vnni on the bench machine. Inductor's FX graph cache does not
key on the picked ISA, so the scalar kernels compiled before would still be served from
/tmp/torchinductor_<user>: with the setting, the script also sets TORCHINDUCTOR_CACHE_DIR (unless
given) to /tmp/torchinductor_<user>_sleef, a cache of its own. The kernels also need SLEEF's
header (libsleef-dev: installed in the root by hand, not in bazelw's package list) and
Python's (python3-dev, which libtorch-dev depends on).
"""

import argparse
import ctypes
import getpass
import json
import os
import statistics
import sys
import tempfile
import time

SLEEF = "libsleef.so.3"


def sleef_global():
    """Makes SLEEF's symbols global here and preloads it in child processes, with a cache of
    Inductor's own (see above). Returns what it did, for the header."""
    try:
        ctypes.CDLL(SLEEF, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        return "not loaded (%s)" % e
    preload = os.environ.get("LD_PRELOAD", "")
    if SLEEF not in preload.replace(":", " ").split():
        os.environ["LD_PRELOAD"] = (SLEEF + " " + preload).strip()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), "torchinductor_%s_sleef" % getpass.getuser()))
    return "global, LD_PRELOAD=%s, TORCHINDUCTOR_CACHE_DIR=%s" % (
        os.environ["LD_PRELOAD"], os.environ["TORCHINDUCTOR_CACHE_DIR"])


SLEEF_STATE = (sleef_global() if "--no_sleef_global" not in sys.argv[1:]
               else "left alone (--no_sleef_global)")

import torch  # noqa: E402 -- after sleef_global(), so that every child inherits LD_PRELOAD

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2
ROWS = ("aten_fused", "ao_8bit", "ao_bf16_sr", "ao_fp32")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total", type=int, default=16 << 20, help="parameters in all")
    p.add_argument("--tensors", default="64,1", help="layouts: tensor counts, comma-separated")
    p.add_argument("--rows", default=",".join(ROWS), help="rows to run, comma-separated")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (one step of each row)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_sleef_global", action="store_true",
                   help="leave SLEEF alone: Debian's Inductor then picks no vector ISA (the flag "
                   "is read before torch is imported)")
    return p.parse_args()


def describe_state(opt):
    """The dtypes of the first parameter's state, read back from the optimizer."""
    p = opt.param_groups[0]["params"][0]
    out = {"param": str(p.dtype).replace("torch.", ""),
           "grad": str(p.grad.dtype).replace("torch.", "")}
    for name in ("exp_avg", "exp_avg_sq"):
        s = opt.state[p][name]
        if hasattr(s, "codes"):  # torchao's OptimState8bit: uint8 codes + a scale per block
            out[name] = "%s codes %s + scale %s per %d" % (
                type(s).__name__, str(s.codes.dtype).replace("torch.", ""),
                str(s.scale.dtype).replace("torch.", ""), s.block_size)
        else:
            out[name] = "%s %s" % (type(s).__name__, str(s.dtype).replace("torch.", ""))
    return out


def make_rows(names, params, grads, torchao):
    """name -> optimizer. The float32 rows share `params` (as the C++ benchmark's rows do)."""
    for p, g in zip(params, grads):
        p.grad = g
    rows, skipped = {}, {}
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    for name in names:
        if name == "aten_fused":
            rows[name] = torch.optim.AdamW(params, fused=True, **kw)
        elif isinstance(torchao, str):
            skipped[name] = torchao
        elif name == "ao_8bit":
            rows[name] = torchao.AdamW8bit(params, block_size=256, **kw)
        elif name == "ao_fp32":
            rows[name] = torchao._AdamW(params, **kw)
        elif name == "ao_bf16_sr":
            bf16 = [p.detach().to(torch.bfloat16) for p in params]
            for p, g in zip(bf16, grads):
                p.grad = g.to(torch.bfloat16)
            rows[name] = torchao._AdamW(bf16, bf16_stochastic_round=True, **kw)
        else:
            raise SystemExit("state_precision_peer: unknown row %s (rows: %s)" %
                             (name, ",".join(ROWS)))
    return rows, skipped


def seconds(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def run_layout(args, count, names, torchao):
    gen = torch.Generator().manual_seed(args.seed + count)
    n = args.total // count
    params = [torch.randn(n, generator=gen) for _ in range(count)]
    grads = [torch.randn(n, generator=gen) for _ in range(count)]
    rows, skipped = make_rows(names, params, grads, torchao)
    first = {name: seconds(opt.step) for name, opt in rows.items()}  # compiles torchao's step
    for _ in range(args.warmup):
        for opt in rows.values():
            opt.step()
    times = {name: [] for name in rows}
    order = list(rows)
    for r in range(args.rounds):  # each round starts one row later: no row always follows another
        for name in order[r % len(order):] + order[:r % len(order)]:
            times[name].append(seconds(rows[name].step))
    control = statistics.fmean(times["aten_fused"]) if "aten_fused" in times else None
    out = []
    for name, opt in rows.items():
        mean = statistics.fmean(times[name])
        out.append({"row": name, "tensors": count, "numel": n * count,
                    "mean_ms": mean * 1e3, "median_ms": statistics.median(times[name]) * 1e3,
                    "min_ms": min(times[name]) * 1e3,
                    "over_aten_fused": mean / control if control else None,
                    "first_step_s": first[name], "rounds": args.rounds,
                    "state": describe_state(opt)})
    for name, why in skipped.items():
        out.append({"row": name, "tensors": count, "skipped": why})
    return out


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    names = [r for r in args.rows.split(",") if r]
    try:
        import torchao
        import torchao.optim as torchao_optim
        ao_version = torchao.__version__
    except Exception as e:  # noqa: BLE001 -- any import failure is reported, not raised
        torchao_optim, ao_version = "torchao import failed: %r" % e, None
    try:  # the SIMD ISA torch.compile's C++ kernels are generated for ("invalid": scalar loops)
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        vec_isa = str(pick_vec_isa()) or "invalid"
    except Exception as e:  # noqa: BLE001
        vec_isa = "unknown (%r)" % e
    print("torch %s, torchao %s, threads %d, ATen cpu capability %s, inductor vec isa %s, "
          "SLEEF %s, %d parameters" % (torch.__version__, ao_version, torch.get_num_threads(),
                                       torch.backends.cpu.get_cpu_capability(), vec_isa,
                                       SLEEF_STATE, args.total))
    results = []
    for count in [int(c) for c in args.tensors.split(",") if c]:
        rows = run_layout(args, count, names, torchao_optim)
        results += rows
        print("\n%d tensors of %d (%d rounds after %d warm-up steps)" %
              (count, args.total // count, args.rounds, args.warmup))
        print("%-11s %9s %9s %9s %8s %11s  %s" % ("row", "mean_ms", "median_ms", "min_ms",
                                              "/aten", "first_s", "param / grad / exp_avg"))
        for r in rows:
            if "skipped" in r:
                print("%-11s skipped %s" % (r["row"], r["skipped"]))
                continue
            s = r["state"]
            print("%-11s %9.2f %9.2f %9.2f %8s %11.2f  %s / %s / %s" % (
                r["row"], r["mean_ms"], r["median_ms"], r["min_ms"],
                "%.2f" % r["over_aten_fused"] if r["over_aten_fused"] else "-",
                r["first_step_s"], s["param"], s["grad"], s["exp_avg"]))
    print()
    for r in results:
        print("json " + json.dumps(r, sort_keys=True))


if __name__ == "__main__":
    main()
