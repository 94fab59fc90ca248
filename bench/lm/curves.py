#!/usr/bin/env python3
"""Reads the runs of lm_train / lm_peer.py -- their CSVs (step,train_loss,val_loss) or their logs
("step N/M  train_loss X  val_loss Y" at every validation, "final train_loss X val_loss Y") -- and
writes, for bench/lm/curves.gp, a table of the validation losses (step, then one column per run,
"?" where a run has none), and prints a Markdown table of the final figures. The first run is the
reference the table's last column compares against.

    python3 bench/lm/curves.py /tmp/lm/curves.dat /tmp/lm/cpp_fp32.csv /tmp/lm/cpp_8bit.log ...
"""
import csv
import os
import re
import sys

STEP = re.compile(r"^step (\d+)/\d+\s+train_loss (\S+)\s+val_loss (\S+)")
FINAL = re.compile(r"^final train_loss (\S+) val_loss (\S+)")


def read(path):
    """(validation losses {step: loss}, final training loss (mean of the last 10 steps), last step)."""
    val, final_train, last = {}, None, 0
    if path.endswith(".csv"):
        train = []
        with open(path) as f:
            for r in csv.DictReader(f):
                step = int(r["step"])
                train.append(float(r["train_loss"]))
                last = max(last, step)
                if r["val_loss"]:
                    val[step] = float(r["val_loss"])
        final_train = sum(train[-10:]) / len(train[-10:])
    else:
        for line in open(path):
            m = STEP.match(line)
            if m:
                val[int(m.group(1))] = float(m.group(3))
                last = max(last, int(m.group(1)))
            m = FINAL.match(line)
            if m:
                final_train = float(m.group(1))
    return val, final_train, last


def main(argv):
    out, paths = argv[0], argv[1:]
    runs = [read(p) for p in paths]
    names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    steps = sorted(set(s for val, _, _ in runs for s in val))
    with open(out, "w") as f:
        f.write("# step " + " ".join(names) + "\n")
        for s in steps:
            f.write("%d %s\n" % (s, " ".join("%.5f" % v[s] if s in v else "?" for v, _, _ in runs)))
    ref = runs[0][0][max(runs[0][0])]
    print("| run | steps | final training loss (mean of the last 10 steps) | final validation loss | vs %s |"
          % names[0])
    print("|---|---|---|---|---|")
    for n, (val, train, last) in zip(names, runs):
        v = val[max(val)]
        print("| %s | %d | %.4f | %.4f | %+.2f%% |" % (n, last, train, v, 100 * (v / ref - 1)))


if __name__ == "__main__":
    main(sys.argv[1:])
