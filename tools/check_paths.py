#!/usr/bin/env python3
"""Checks that every repository path named in a comment, a doc or the README exists.

    python3 tools/check_paths.py     # exits 1, naming each file:line and missing path; CI runs it

A path is a word that starts with one of the repository's top-level folders and a slash
(`optim/zero/options.h`, `bench/gpu/RESULTS.md`, `docs/`), read from every source, BUILD,
script and Markdown file. Bazel labels (`//optim/zero:zero_redundancy_optimizer`) are checked as
their package folder plus, for a file label, the file. Paths that are examples, not files, are
skipped when they contain a placeholder (`<name>`, `*`, `{`, `...`, `$`) or sit inside the
`paths-example:` escape (a line holding that word is not checked). Generated outputs (build/,
bazel-*) are not repository paths.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = ("bench", "checkpoint", "cmake", "comm", "ddp_hooks", "docs", "examples", "fuzz", "launcher",
       "optim", "partition", "rpc", "testing", "third_party", "tools", ".ci")
SUFFIXES = (".h", ".cc", ".md", ".py", ".sh", ".bazel", ".bzl", ".cmake", ".txt", ".in", ".csv",
            ".json", ".pt", ".yaml")
PATH = re.compile(r"(?<![\w./@-])(?:(//)?((?:%s)/[\w./+-]*)(?::([\w./+-]+))?)" %
                  "|".join(re.escape(t) for t in TOP))
# A source file named without its folder (zero_overlap.h, internal/layout.h): some tracked file
# must end with it. Names under other projects' include roots are not ours.
BARE = re.compile(r"(?<![\w./@<%-])([\w][\w/-]*\.(?:h|cc))(?![\w/])")
EXTERNAL = ("torch/", "ATen/", "c10/", "gloo/", "absl/", "gtest/", "gmock/", "benchmark/", "google/",
            "tensorpipe/", "cuda", "nccl", "sys/", "linux/", "bits/", "c10d/", "pybind11/", "caffe2/")
# A file of another project named in prose ("abseil `cleanup.h`").
OTHER_PROJECT = re.compile(r"(abseil|leveldb|tensorstore|gloo|pytorch|torch|torchft|torchao|megatron)\W*$",
                           re.I)
PLACEHOLDER = re.compile(r"[<*{$]|\.\.\.")
ESCAPE = "paths-example:"
# Files whose paths are a scratch tree's, not the repository's (with the reason).
SKIP_FILES = {
    "tools/check_layering_test.py": "writes a scratch repository of its own",
    "cmake/bazel_to_cmake_test.py": "writes a scratch repository of its own",
    "tools/check_paths_test.py": "writes a scratch repository of its own",
    "tools/check_paths.py": "its comments show the kinds of path it accepts",
}


# What .gitignore leaves out (build outputs), skipped when walking the tree: the check needs no git.
IGNORED_DIRS = ("bazel-", "build", "gpu_bundle", "__pycache__", ".git", ".bench_results")


def repository_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(IGNORED_DIRS))
        for name in sorted(filenames):
            yield os.path.relpath(os.path.join(dirpath, name), ROOT)


def tracked_files():
    for f in repository_files():
        if f and (f.endswith(SUFFIXES) or os.path.basename(f) in ("BUILD.bazel", "run", "cmake",
                                                                     "format", "bazelw")):
            yield f


_TRACKED = None


def tracked_paths():
    global _TRACKED
    if _TRACKED is None:
        _TRACKED = set(repository_files())
        for f in list(_TRACKED):
            d = os.path.dirname(f)
            while d:
                _TRACKED.add(d + "/")
                d = os.path.dirname(d)
    return _TRACKED


_TARGETS = None


def target_names():
    """Every target name in a BUILD file (generated headers are named by their rule)."""
    global _TARGETS
    if _TARGETS is None:
        _TARGETS = set()
        for f in tracked_paths():
            if f.endswith("BUILD.bazel"):
                text = open(os.path.join(ROOT, f)).read()
                _TARGETS.update(re.findall(r'name = "([\w.-]+)"', text))
    return _TARGETS


def exists(rel):
    """A file or folder; a library named without its extension (rpc/codec); a Bazel target or
    genrule output named by its package folder (examples/train, launcher/launch); a CMake folder
    target (rpc/all); a path relative to a package (testing/zero_test_util.h under optim/zero)."""
    rel = rel.rstrip("/") if rel.endswith("/") and len(rel) > 1 else rel
    if os.path.exists(os.path.join(ROOT, rel)):
        return True
    if any(os.path.exists(os.path.join(ROOT, rel + ext)) for ext in (".h", ".cc", ".py", ".sh")):
        return True
    pkg, base = os.path.dirname(rel), os.path.basename(rel)
    if base == "all" and os.path.exists(os.path.join(ROOT, pkg, "CMakeLists.txt")):
        return True
    d = pkg
    while d:
        build = os.path.join(ROOT, d, "BUILD.bazel")
        if os.path.exists(build):
            first = rel[len(d) + 1:].split("/")[0]
            stem = first.split(".")[0]
            text = open(build).read()
            if '"%s' % first in text or '"%s"' % stem in text:  # a target, or a rule's output
                return True
            break
        d = os.path.dirname(d)
    suffix = "/" + rel
    return any(t.endswith(suffix) or t.rstrip("/").endswith(suffix) for t in tracked_paths())


def check_line(f, n, line, problems):
    if ESCAPE in line or line.lstrip().startswith("#include"):
        return
    for m in BARE.finditer(line):
        name = m.group(1)
        if (name.startswith(TOP) or any(("/" + e) in ("/" + name) for e in EXTERNAL) or
                "/" not in name and name[0].isupper() or OTHER_PROJECT.search(line[:m.start()])):
            continue
        suffix = "/" + name
        stem = os.path.basename(name).split(".")[0]
        if stem not in target_names() and not any(t == name or t.endswith(suffix)
                                                  for t in tracked_paths()):
            problems.append("%s:%d: %s: no tracked file has this name" % (f, n, name))
    for m in PATH.finditer(line):
        label, path, target = m.group(1), m.group(2), m.group(3)
        whole = m.group(0)
        end = m.end()
        if PLACEHOLDER.search(whole) or line[end:end + 1] in ("<", "*", "{", "$"):
            continue
        path = path.rstrip(".,;")
        if label:  # a Bazel label: //pkg[:target]
            pkg = path.rstrip("/").rstrip(".")
            if pkg.endswith("/"):
                pkg = pkg[:-1]
            if not exists(os.path.join(pkg, "BUILD.bazel")):
                problems.append("%s:%d: //%s: no such package" % (f, n, pkg))
            elif target and "." in target and not target.endswith(".") and not exists(os.path.join(pkg, target)) \
                    and not exists(os.path.join(pkg, target.split("/")[-1])):
                # a file label; a target name with a dot is rare, so a missing file is a problem
                problems.append("%s:%d: //%s:%s: no such file" % (f, n, pkg, target))
            continue
        if not (path.endswith(SUFFIXES) or path.endswith("/")):
            # a folder or a file without a checked extension: checked only if it looks like a path
            # to something that should exist (a folder or an extensionless script)
            if not exists(path) and "." not in os.path.basename(path):
                problems.append("%s:%d: %s: no such file or folder" % (f, n, path))
            continue
        if not exists(path):
            problems.append("%s:%d: %s: no such file or folder" % (f, n, path))


def main(argv):
    problems = []
    for f in tracked_files():
        if f in SKIP_FILES:
            continue
        try:
            text = open(os.path.join(ROOT, f), encoding="utf-8").read()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for n, line in enumerate(text.split("\n"), 1):
            check_line(f, n, line, problems)
    for p in problems:
        print(p)
    print("check_paths: %d missing path(s)" % len(problems), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
