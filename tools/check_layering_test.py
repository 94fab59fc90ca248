#!/usr/bin/env python3
"""tools/check_layering.py fails on an edge that breaks docs/ARCHITECTURE.md's rules.

In a scratch repository with comm, optim/zero and rpc packages laid out as dtrain's are, the check
passes; then it fails, naming the target or file, on a deliberate optim/zero -> rpc BUILD edge,
on an #include of rpc from optim/zero that no BUILD edge shows, on an include of another
package's internal/ header, and on LibTorch in the launcher; and passes again once each is undone.
"""
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
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
    p = subprocess.run([sys.executable, os.path.join(root, "tools", "check_layering.py")],
                       capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


root = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
for rel in ("cmake/bazel_to_cmake.py", "tools/check_layering.py"):
    os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
    shutil.copy(os.path.join(REPO, rel), os.path.join(root, rel))
LIB = 'load("@rules_cc//cc:defs.bzl", "cc_library")\n'
write(root, "comm/BUILD.bazel", LIB + 'cc_library(name = "pg", srcs = ["pg.cc"], hdrs = ["pg.h"])\n'
      'cc_library(name = "rdzv", hdrs = ["internal/rdzv.h"])\n')
write(root, "comm/pg.h", "")
write(root, "comm/pg.cc", '#include "comm/pg.h"\n#include "comm/internal/rdzv.h"\n')
write(root, "comm/internal/rdzv.h", "")
write(root, "rpc/BUILD.bazel", LIB + 'cc_library(name = "agent", hdrs = ["agent.h"], deps = ["//comm:pg"])\n')
write(root, "rpc/agent.h", '#include "comm/pg.h"\n')
write(root, "launcher/BUILD.bazel", LIB + 'cc_library(name = "run", srcs = ["run.cc"])\n')
write(root, "launcher/run.cc", "")
ZERO_BUILD = LIB + 'cc_library(name = "zero", srcs = ["zero.cc"], deps = ["//comm:pg"%s])\n'
write(root, "optim/zero/BUILD.bazel", ZERO_BUILD % "")
write(root, "optim/zero/zero.cc", '#include "comm/pg.h"\n')

rc, out = run(root)
check(rc == 0, "a tree that keeps the rules passes (%s)" % out.strip())

write(root, "optim/zero/BUILD.bazel", ZERO_BUILD % ', "//rpc:agent"')
rc, out = run(root)
check(rc == 1 and "//optim/zero:zero: deps on //rpc:agent: optim/zero may not depend on rpc" in out,
      "an optim/zero -> rpc BUILD edge fails, naming the target (%s)" % out.strip())
write(root, "optim/zero/BUILD.bazel", ZERO_BUILD % "")

write(root, "optim/zero/zero.cc", '#include "comm/pg.h"\n#include "rpc/agent.h"\n')
rc, out = run(root)
check(rc == 1 and "optim/zero/zero.cc: includes rpc/agent.h: optim/zero may not depend on rpc" in out,
      "an include Bazel cannot see fails, naming the file (%s)" % out.strip())

write(root, "optim/zero/zero.cc", '#include "comm/internal/rdzv.h"\n')
rc, out = run(root)
check(rc == 1 and "another package's internal header" in out,
      "another package's internal/ header fails (%s)" % out.strip())
write(root, "optim/zero/zero.cc", '#include "comm/pg.h"\n')

write(root, "launcher/BUILD.bazel", LIB + 'cc_library(name = "run", srcs = ["run.cc"], '
      'deps = ["@libtorch//:torch"])\n')
rc, out = run(root)
check(rc == 1 and "launcher uses no LibTorch" in out, "LibTorch in the launcher fails (%s)" % out.strip())
write(root, "launcher/BUILD.bazel", LIB + 'cc_library(name = "run", srcs = ["run.cc"])\n')

rc, out = run(root)
check(rc == 0, "undone, the check passes again (%s)" % out.strip())
shutil.rmtree(root, ignore_errors=True)
print("%d check(s) failed" % len(failures) if failures else "all checks passed")
sys.exit(1 if failures else 0)
