#!/usr/bin/env python3
"""tools/check_paths.py fails on a path a comment or doc names that does not exist.

In a scratch repository it passes, then fails naming file:line for a doc's missing path, a
comment's renamed header given without its folder (the drift the optim/ split left), and a label
of a missing package; the `paths-example:` escape and a Bazel target named by its folder pass.
"""
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
failures = []


def check(cond, what):
    print(("ok:   " if cond else "FAIL: ") + what)
    if not cond:
        failures.append(what)


def write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def run(root):
    p = subprocess.run([sys.executable, os.path.join(root, "tools", "check_paths.py")],
                       capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


root = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
os.makedirs(os.path.join(root, "tools"))
shutil.copy(os.path.join(REPO, "tools", "check_paths.py"), os.path.join(root, "tools"))
write(root, "optim/zero/BUILD.bazel", 'cc_binary(name = "train", srcs = ["layout.cc"])\n')
write(root, "optim/zero/layout.h", "// The layouts (layout.cc); see optim/zero/layout.h and //optim/zero:train.\n")
write(root, "optim/zero/layout.cc", "")
write(root, "docs/a.md", "Run optim/zero/train (a target), read `optim/zero/layout.h`.\n")

rc, out = run(root)
check(rc == 0, "paths that exist pass (%s)" % out.strip())

write(root, "docs/a.md", "Run optim/zero/train, read `optim/zero/zero_layout.h`.\n")
rc, out = run(root)
check(rc == 1 and "docs/a.md:1: optim/zero/zero_layout.h" in out, "a doc's missing path fails (%s)" % out.strip())
write(root, "docs/a.md", "Read `optim/zero/zero_layout.h` (paths-example: a name to make up).\n")
rc, out = run(root)
check(rc == 0, "the paths-example: escape passes (%s)" % out.strip())

write(root, "optim/zero/layout.cc", "// FlatLayout (see zero_layout.h).\n")
rc, out = run(root)
check(rc == 1 and "optim/zero/layout.cc:1: zero_layout.h" in out,
      "a renamed header named without its folder fails (%s)" % out.strip())
write(root, "optim/zero/layout.cc", "// FlatLayout (see layout.h).\n")

write(root, "optim/zero/layout.h", "// Built by //optim/zro:train.\n")
rc, out = run(root)
check(rc == 1 and "//optim/zro: no such package" in out, "a label of a missing package fails (%s)" % out.strip())
write(root, "optim/zero/layout.h", "")

rc, out = run(root)
check(rc == 0, "fixed, the check passes again (%s)" % out.strip())
shutil.rmtree(root, ignore_errors=True)
print("%d check(s) failed" % len(failures) if failures else "all checks passed")
sys.exit(1 if failures else 0)
