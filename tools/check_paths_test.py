#!/usr/bin/env python3
"""tools/check_paths.py fails on a path a comment or doc names that does not exist.

In a scratch repository it passes, then fails naming file:line for a doc's missing path, a
comment's renamed header given without its folder (the drift the optim/ split left), and a label
of a missing package; the `paths-example:` escape and a Bazel target named by its folder pass.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scratch_repo import ScratchRepo  # noqa: E402

repo = ScratchRepo(["tools/check_paths.py"])
repo.write("optim/zero/BUILD.bazel", 'cc_binary(name = "train", srcs = ["layout.cc"])\n')
repo.write("optim/zero/layout.h", "// The layouts (layout.cc); see optim/zero/layout.h and //optim/zero:train.\n")
repo.write("optim/zero/layout.cc", "")
repo.write("docs/a.md", "Run optim/zero/train (a target), read `optim/zero/layout.h`.\n")

rc, out = repo.run("tools/check_paths.py")
repo.check(rc == 0, "paths that exist pass (%s)" % out.strip())

repo.write("docs/a.md", "Run optim/zero/train, read `optim/zero/zero_layout.h`.\n")
rc, out = repo.run("tools/check_paths.py")
repo.check(rc == 1 and "docs/a.md:1: optim/zero/zero_layout.h" in out, "a doc's missing path fails (%s)" % out.strip())
repo.write("docs/a.md", "Read `optim/zero/zero_layout.h` (paths-example: a name to make up).\n")
rc, out = repo.run("tools/check_paths.py")
repo.check(rc == 0, "the paths-example: escape passes (%s)" % out.strip())

repo.write("optim/zero/layout.cc", "// FlatLayout (see zero_layout.h).\n")
rc, out = repo.run("tools/check_paths.py")
repo.check(rc == 1 and "optim/zero/layout.cc:1: zero_layout.h" in out,
      "a renamed header named without its folder fails (%s)" % out.strip())
repo.write("optim/zero/layout.cc", "// FlatLayout (see layout.h).\n")

repo.write("optim/zero/layout.h", "// Built by //optim/zro:train.\n")
rc, out = repo.run("tools/check_paths.py")
repo.check(rc == 1 and "//optim/zro: no such package" in out, "a label of a missing package fails (%s)" % out.strip())
repo.write("optim/zero/layout.h", "")

rc, out = repo.run("tools/check_paths.py")
repo.check(rc == 0, "fixed, the check passes again (%s)" % out.strip())
sys.exit(repo.finish())
