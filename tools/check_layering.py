#!/usr/bin/env python3
"""Checks docs/ARCHITECTURE.md's dependency rules on every BUILD edge and every #include.

    python3 tools/check_layering.py      # exits 1, naming each edge that breaks a rule; CI runs it

Two views, because each sees what the other cannot: the BUILD files' deps and data (evaluated as
cmake/bazel_to_cmake.py evaluates them, so no Bazel is needed), and the quoted #includes of every
C++ file (a header reached through a transitive dep is invisible to the first). Rules:
  * a package may depend only on the layers ALLOWED lists for its layer (the table in
    docs/ARCHITECTURE.md, "Dependency direction"); tests, benchmarks and testonly targets may
    also use //testing and comm/testing's harness;
  * no file includes another package's internal/ headers;
  * launcher and partition use no LibTorch.
An exception is an edge in EXCEPTIONS with its reason; docs/ARCHITECTURE.md lists the same ones.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "cmake"))
import bazel_to_cmake  # noqa: E402  (the one BUILD evaluator)

# Layer -> the layers it may depend on (itself always). Mirrors docs/ARCHITECTURE.md.
ALLOWED = {
    "launcher": set(),
    "partition": set(),
    "comm": set(),
    "comm/testing": {"comm", "launcher"},
    "checkpoint": {"comm", "partition"},
    "optim/functional": {"checkpoint"},
    "optim/zero": {"optim/functional", "comm", "partition", "checkpoint"},
    "optim": {"optim/functional", "optim/zero", "comm", "checkpoint"},
    "ddp_hooks": {"comm", "optim", "optim/functional", "optim/zero", "partition", "checkpoint"},
    "rpc": {"comm", "optim/functional", "checkpoint"},
    "testing": set(),
    "cmake": set(),
    "tools": {"cmake"},  # the checks read BUILD files through cmake/bazel_to_cmake.py
}
ANYTHING = ("bench", "examples", "fuzz")  # the top layer
TEST_ONLY_LAYERS = {"testing", "comm/testing"}  # usable by any test, benchmark or testonly target
NO_LIBTORCH = ("launcher", "partition")
# Targets (and the files they build from) that may break the table, with the reason. Keep
# docs/ARCHITECTURE.md's list the same.
EXCEPTIONS = {
    "//rpc:seed_example": "an example program (top layer) kept beside the package it shows",
    "//rpc:parameter_server_example": "an example program (top layer) kept beside the package it shows",
}
EXCEPTION_FILES = {"rpc/seed_example.cc", "rpc/parameter_server_example.cc"}


def layer_of(pkg):
    """The layer a package (a path like optim/functional/testing) belongs to."""
    if pkg.split("/")[0] in ANYTHING:
        return pkg.split("/")[0]
    best = None
    for layer in ALLOWED:
        if (pkg == layer or pkg.startswith(layer + "/")) and (best is None or len(layer) > len(best)):
            best = layer
    # A package's own testing/ folder belongs to the package (optim/functional/testing), except
    # comm/testing, a layer of its own.
    return best


def may_depend(src, dst, testish):
    if src == dst or src in ANYTHING:
        return True
    if testish and dst in TEST_ONLY_LAYERS:
        return True
    return dst in ALLOWED.get(src, set())


def is_testish(kind, attrs, path=""):
    name = attrs.get("name", "") if attrs else ""
    base = os.path.basename(path)
    return (kind in ("cc_test", "sh_test") or attrs.get("testonly", False) or
            name.endswith(("_test", "_benchmark")) or
            re.search(r"(_test|_benchmark|_fuzzer)\.(cc|h)$", base) is not None or "/testing/" in path)


def build_edges():
    """Yields (package, target, kind, attrs, dep label, attribute) for every dep and data edge."""
    for pkg in bazel_to_cmake.packages():
        for has_agent in (False, True):
            p = bazel_to_cmake.evaluate(pkg, has_agent)
            for kind, attrs in p.rules:
                for attr in ("deps", "data", "actual"):
                    values = attrs.get(attr, [])
                    if isinstance(values, str):
                        values = [values]
                    if not isinstance(values, list):
                        continue
                    for v in values:
                        if isinstance(v, str) and (v.startswith(("//", ":", "@"))):
                            yield pkg, attrs.get("name", "?"), kind, attrs, p.label(v), attr


def check_build(problems):
    seen = set()
    for pkg, name, kind, attrs, dep, attr in build_edges():
        src = layer_of(pkg)
        if dep.startswith("@"):
            if src in NO_LIBTORCH and dep.startswith("@libtorch"):
                problems.add("//%s:%s: %s %s: %s uses no LibTorch (docs/ARCHITECTURE.md)" %
                             (pkg, name, attr, dep, src))
            continue
        dpkg = dep[2:].split(":")[0]
        dst = layer_of(dpkg)
        if dst is None or src is None:
            continue
        if "//%s:%s" % (pkg, name) in EXCEPTIONS:
            continue
        if not may_depend(src, dst, is_testish(kind, attrs)):
            key = (pkg, name, dep)
            if key not in seen:
                seen.add(key)
                problems.add("//%s:%s: %s on %s: %s may not depend on %s (docs/ARCHITECTURE.md, "
                             "\"Dependency direction\")" % (pkg, name, attr, dep, src, dst))


INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def package_dirs():
    return set(bazel_to_cmake.packages())


def package_of_file(path, pkgs):
    d = os.path.dirname(path)
    while d and d not in pkgs:
        d = os.path.dirname(d)
    return d or None


def testonly_files():
    """Files (pkg/name) that only testonly or test targets list in srcs/hdrs: test code by BUILD."""
    listed = {}
    for pkg in bazel_to_cmake.packages():
        for has_agent in (False, True):
            for kind, attrs in bazel_to_cmake.evaluate(pkg, has_agent).rules:
                for attr in ("srcs", "hdrs"):
                    values = attrs.get(attr, [])
                    for v in values if isinstance(values, list) else []:
                        if isinstance(v, str) and not v.startswith(("//", ":", "@")):
                            path = os.path.join(pkg, v)
                            listed[path] = listed.get(path, True) and is_testish(kind, attrs)
    return {path for path, testish in listed.items() if testish}


def check_includes(problems):
    pkgs = package_dirs()
    test_files = testonly_files()
    for pkg in sorted(pkgs):
        for f in sorted(os.listdir(os.path.join(ROOT, pkg))):
            if not f.endswith((".h", ".cc")):
                continue
            path = os.path.join(pkg, f)
            if path in EXCEPTION_FILES:
                continue
            text = open(os.path.join(ROOT, path), encoding="utf-8", errors="replace").read()
            src = layer_of(pkg)
            for inc in INCLUDE.findall(text):
                ipkg = package_of_file(inc, pkgs)
                if ipkg is None or not os.path.exists(os.path.join(ROOT, inc)):
                    continue  # generated or not ours
                if "/internal/" in "/" + inc and not (pkg == ipkg or pkg.startswith(ipkg + "/")):
                    parts = inc.split("/internal/")[0]
                    if not (pkg == parts or pkg.startswith(parts + "/")):
                        problems.add("%s: includes %s, another package's internal header" % (path, inc))
                        continue
                dst = layer_of(ipkg)
                testish = is_testish("", {}, path) or path in test_files
                if dst and src and not may_depend(src, dst, testish):
                    problems.add("%s: includes %s: %s may not depend on %s (docs/ARCHITECTURE.md, "
                                 "\"Dependency direction\")" % (path, inc, src, dst))


def main(argv):
    problems = set()
    check_build(problems)
    check_includes(problems)
    for p in sorted(problems):
        print(p)
    print("check_layering: %d problem(s)" % len(problems), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
