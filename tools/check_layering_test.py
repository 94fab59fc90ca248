#!/usr/bin/env python3
"""tools/check_layering.py fails on an edge that breaks docs/ARCHITECTURE.md's rules.

In a scratch repository with comm, optim/zero and rpc packages laid out as dtrain's are, the check
passes; then it fails, naming the target or file, on a deliberate optim/zero -> rpc BUILD edge,
on an #include of rpc from optim/zero that no BUILD edge shows, on an include of another
package's internal/ header, and on LibTorch in the launcher; and passes again once each is undone.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scratch_repo import ScratchRepo  # noqa: E402

repo = ScratchRepo(["cmake/bazel_to_cmake.py", "tools/check_layering.py"])
LIB = 'load("@rules_cc//cc:defs.bzl", "cc_library")\n'
repo.write("comm/BUILD.bazel", LIB + 'cc_library(name = "pg", srcs = ["pg.cc"], hdrs = ["pg.h"])\n'
      'cc_library(name = "rdzv", hdrs = ["internal/rdzv.h"])\n')
repo.write("comm/pg.h", "")
repo.write("comm/pg.cc", '#include "comm/pg.h"\n#include "comm/internal/rdzv.h"\n')
repo.write("comm/internal/rdzv.h", "")
repo.write("rpc/BUILD.bazel", LIB + 'cc_library(name = "agent", hdrs = ["agent.h"], deps = ["//comm:pg"])\n')
repo.write("rpc/agent.h", '#include "comm/pg.h"\n')
repo.write("launcher/BUILD.bazel", LIB + 'cc_library(name = "run", srcs = ["run.cc"])\n')
repo.write("launcher/run.cc", "")
ZERO_BUILD = LIB + 'cc_library(name = "zero", srcs = ["zero.cc"], deps = ["//comm:pg"%s])\n'
repo.write("optim/zero/BUILD.bazel", ZERO_BUILD % "")
repo.write("optim/zero/zero.cc", '#include "comm/pg.h"\n')

rc, out = repo.run("tools/check_layering.py")
repo.check(rc == 0, "a tree that keeps the rules passes (%s)" % out.strip())

repo.write("optim/zero/BUILD.bazel", ZERO_BUILD % ', "//rpc:agent"')
rc, out = repo.run("tools/check_layering.py")
repo.check(rc == 1 and "//optim/zero:zero: deps on //rpc:agent: optim/zero may not depend on rpc" in out,
      "an optim/zero -> rpc BUILD edge fails, naming the target (%s)" % out.strip())
repo.write("optim/zero/BUILD.bazel", ZERO_BUILD % "")

repo.write("optim/zero/zero.cc", '#include "comm/pg.h"\n#include "rpc/agent.h"\n')
rc, out = repo.run("tools/check_layering.py")
repo.check(rc == 1 and "optim/zero/zero.cc: includes rpc/agent.h: optim/zero may not depend on rpc" in out,
      "an include Bazel cannot see fails, naming the file (%s)" % out.strip())

repo.write("optim/zero/zero.cc", '#include "comm/internal/rdzv.h"\n')
rc, out = repo.run("tools/check_layering.py")
repo.check(rc == 1 and "another package's internal header" in out,
      "another package's internal/ header fails (%s)" % out.strip())
repo.write("optim/zero/zero.cc", '#include "comm/pg.h"\n')

repo.write("launcher/BUILD.bazel", LIB + 'cc_library(name = "run", srcs = ["run.cc"], '
      'deps = ["@libtorch//:torch"])\n')
rc, out = repo.run("tools/check_layering.py")
repo.check(rc == 1 and "launcher uses no LibTorch" in out, "LibTorch in the launcher fails (%s)" % out.strip())
repo.write("launcher/BUILD.bazel", LIB + 'cc_library(name = "run", srcs = ["run.cc"])\n')

# A header only a testonly library lists is test code: it may include //testing; the same header
# in a library that is not testonly may not.
repo.write("testing/BUILD.bazel", LIB + 'cc_library(name = "util", testonly = True, hdrs = ["util.h"])\n')
repo.write("testing/util.h", "")
repo.write("comm/files.h", '#include "testing/util.h"\n')
FILES = 'cc_library(name = "files", %shdrs = ["files.h"], deps = ["//testing:util"])\n'
comm = open(os.path.join(repo.root, "comm/BUILD.bazel")).read()
repo.write("comm/BUILD.bazel", comm + FILES % "testonly = True, ")
rc, out = repo.run("tools/check_layering.py")
repo.check(rc == 0, "a testonly library's header includes //testing (%s)" % out.strip())
repo.write("comm/BUILD.bazel", comm + FILES % "")
rc, out = repo.run("tools/check_layering.py")
repo.check(rc == 1 and "comm/files.h: includes testing/util.h" in out,
      "the same header in a library that ships fails (%s)" % out.strip())
repo.write("comm/BUILD.bazel", comm)
os.remove(os.path.join(repo.root, "comm/files.h"))

rc, out = repo.run("tools/check_layering.py")
repo.check(rc == 0, "undone, the check passes again (%s)" % out.strip())
sys.exit(repo.finish())
