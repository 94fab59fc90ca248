#!/usr/bin/python3
"""Prints the ZeRO side-by-side markdown table from a PyTorch peer output and a zero_benchmark
console output:
    /usr/bin/python3 bench/peers/zero_pytorch.py > /tmp/py.txt
    ./bazelw run -c opt //optim:zero_benchmark > /tmp/dt.txt
    python3 bench/zero_table.py /tmp/py.txt /tmp/dt.txt"""
import re
import sys

py = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) == 5 and f[0] in ("equal", "dominant"):
        py[(f[0], f[1])] = (float(f[2]), float(f[4]))
dt = {}
for line in open(sys.argv[2]):
    m = re.match(r"BM_Zero/model:(\d)/config:(\d)/torch_optim:0", line)
    if not m:
        continue
    model = "equal" if m.group(1) == "0" else "dominant"
    cfg = {"1": "per_param", "2": "bucket_view", "3": "flat"}.get(m.group(2))
    if cfg is None:
        continue
    step = float(re.search(r"step_ms=([\d.]+)", line).group(1))
    cons = float(re.search(r"consolidate_ms=([\d.]+)", line).group(1))
    dt[(model, cfg)] = (step, cons)
print("| model | sync | PyTorch step ms | dtrain step ms | ratio | PyTorch consolidate ms | dtrain consolidate ms |")
print("|---|---|---|---|---|---|---|")
for model in ("equal", "dominant"):
    for cfg in ("per_param", "bucket_view", "flat"):
        d = dt.get((model, cfg))
        p = py.get((model, cfg))
        if d is None:
            continue
        if p is None:
            print("| %s | %s (dtrain only) | - | %.1f | - | - | %.0f |" % (model, cfg, d[0], d[1]))
        else:
            print("| %s | %s | %.1f | %.1f | %.2f | %.0f | %.0f |" % (model, cfg, p[0], d[0], d[0] / p[0], p[1], d[1]))
