#!/usr/bin/env python3
"""The twin check: cmake/bazel_to_cmake.py --check fails when a target is in one build only.

In a scratch repository of two packages it generates the CMake lists, then shows --check failing
on a library added to BUILD.bazel only, on a library added to a CMakeLists.txt by hand, on a new
package, and the generator refusing a BUILD attribute it would otherwise drop; and passing again
once regenerated.
"""
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATOR = os.path.join(HERE, "bazel_to_cmake.py")
failures = []


def check(cond, what):
    print(("ok:   " if cond else "FAIL: ") + what)
    if not cond:
        failures.append(what)


def run(root, *args):
    p = subprocess.run([sys.executable, os.path.join(root, "cmake", "bazel_to_cmake.py")] + list(args),
                       capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def write(root, rel, text, mode="w"):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as f:
        f.write(text)


root = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
os.makedirs(os.path.join(root, "cmake"))
shutil.copy(GENERATOR, os.path.join(root, "cmake", "bazel_to_cmake.py"))
write(root, "a/BUILD.bazel", '''
load("@rules_cc//cc:defs.bzl", "cc_library", "cc_test")
cc_library(name = "x", srcs = ["x.cc"], hdrs = ["x.h"], deps = ["//b:y", "@libtorch//:torch"])
cc_test(name = "x_test", size = "small", srcs = ["x_test.cc"], deps = [":x"], data = glob(["testdata/*"]))
''')
write(root, "b/BUILD.bazel", '''
load("@libtorch//:config.bzl", "HAS_TENSORPIPE_AGENT")
load(":macros.bzl", "twice")
NEEDS_AGENT = [] if HAS_TENSORPIPE_AGENT else ["manual"]
cc_library(name = "y", srcs = ["y.cc"], tags = NEEDS_AGENT)
twice("z")
''')
write(root, "b/macros.bzl", '''
def twice(name):
    native.cc_library(name = name + "_1", srcs = [name + ".cc"])
    native.cc_library(name = name + "_2", srcs = [name + ".cc"], deps = [":" + name + "_1"])
''')

rc, out = run(root)
check(rc == 0, "generates from BUILD files (%s)" % out.strip())
a = open(os.path.join(root, "a/CMakeLists.txt")).read()
b = open(os.path.join(root, "b/CMakeLists.txt")).read()
check("NAME x\n  SRCS x.cc\n  HDRS x.h\n  DEPS //b:y @libtorch//:torch" in a, "a library's sources, headers, deps")
check("DATA glob:testdata/*" in a and "SIZE small" in a, "a test's data glob and size")
check("NEEDS TENSORPIPE_AGENT" in b, "a target that needs the RPC agent says so")
check("NAME z_2" in b and "DEPS //b:z_1" in b, "a macro's targets")
check(open(os.path.join(root, "cmake/packages.cmake")).read().endswith("dtrain_package(a)\ndtrain_package(b)\n"),
      "packages.cmake lists the packages")
rc, out = run(root, "--check")
check(rc == 0, "--check passes on what it generated")

# A library in Bazel only: CI fails, naming the stale list.
write(root, "a/BUILD.bazel", 'cc_library(name = "only_in_bazel", srcs = ["o.cc"])\n', "a")
rc, out = run(root, "--check")
check(rc == 1 and "a/CMakeLists.txt" in out, "a library in BUILD.bazel only fails --check (%s)" % out.strip())
run(root)
rc, out = run(root, "--check")
check(rc == 0, "regenerated, --check passes again")

# A library in CMake only: a hand edit of a generated list fails too.
write(root, "b/CMakeLists.txt", "dtrain_cc_library(\n  NAME only_in_cmake\n  SRCS o.cc\n)\n", "a")
rc, out = run(root, "--check")
check(rc == 1 and "b/CMakeLists.txt" in out, "a library in CMakeLists.txt only fails --check")
run(root)

# A new package must be listed, and its list written.
write(root, "c/BUILD.bazel", 'cc_library(name = "w", hdrs = ["w.h"])\n')
rc, out = run(root, "--check")
check(rc == 1 and "c/CMakeLists.txt" in out and "cmake/packages.cmake" in out, "a new package fails --check")
run(root)

# An attribute the CMake rules do not know is refused, not dropped.
write(root, "c/BUILD.bazel", 'cc_library(name = "v", hdrs = ["v.h"], includes = ["."])\n', "a")
rc, out = run(root)
check(rc != 0 and "includes" in out, "an unknown attribute is refused (%s)" % out.strip().splitlines()[-1])

shutil.rmtree(root)
print("%d check(s) failed" % len(failures) if failures else "all checks passed")
sys.exit(1 if failures else 0)
