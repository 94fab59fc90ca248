#!/usr/bin/env python3
"""Writes each package's CMakeLists.txt from its BUILD.bazel: the one owner of every target's sources,
headers, dependencies, data, tags and options is BUILD.bazel; the CMake lists are derived from it.

    python3 cmake/bazel_to_cmake.py           # rewrites every generated CMakeLists.txt
    python3 cmake/bazel_to_cmake.py --check   # exits 1 (naming the files) if any is stale: CI runs it

BUILD files are evaluated as the Starlark subset they use (Python syntax): cc_library, cc_test,
cc_binary, sh_test, genrule, alias, exports_files, package, package_group and glob, with load()
of the package's own .bzl macros (evaluated the same way) and of @libtorch//:config.bzl. What the
LibTorch found decides is not known here: BUILD files are evaluated twice, with and without
HAS_TENSORPIPE_AGENT, and a target whose tags differ gets `NEEDS TENSORPIPE_AGENT` (CMake then
treats it as Bazel treats a manual target where the agent is missing). The rules that read the
output are in cmake/dtrain_rules.cmake; docs/cmake.md says how the two builds stay one.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Not dtrain's packages: third_party's local repositories, the module-consumer example (its own
# Bazel workspace) and Bazel's output links.
SKIP = ("third_party", "examples/consumer", "bazel-")
HEADER = ("# Generated from {pkg}/BUILD.bazel by cmake/bazel_to_cmake.py. Do not edit: change BUILD.bazel,\n"
          "# then run `python3 cmake/bazel_to_cmake.py` (CI checks that this file is current).\n")


def packages():
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = os.path.relpath(dirpath, ROOT)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not d.startswith("bazel-"))
        if rel == "." or rel.startswith(SKIP):
            continue
        if "BUILD.bazel" in filenames:
            out.append(rel)
    return sorted(out)


class Glob:
    """A glob() kept as patterns: CMake expands it, so a new test data file needs no regeneration."""

    def __init__(self, include):
        self.include = list(include)

    def __add__(self, other):
        raise ValueError("glob() + list is not supported by cmake/bazel_to_cmake.py; use one glob")


class Package:
    def __init__(self, pkg, has_agent):
        self.pkg = pkg
        self.has_agent = has_agent
        self.rules = []  # (kind, attrs) in BUILD order

    def label(self, x):
        """Normalises a label to //pkg:name (external ones, @repo//..., unchanged)."""
        if x.startswith("@"):
            return x
        if x.startswith("//"):
            return x if ":" in x else x + ":" + x.rsplit("/", 1)[-1]
        if x.startswith(":"):
            return "//%s%s" % (self.pkg, x)
        return "//%s:%s" % (self.pkg, x)

    def rule(self, kind):
        def record(**attrs):
            self.rules.append((kind, attrs))
        return record

    def namespace(self):
        ns = {}
        for kind in ("cc_library", "cc_test", "cc_binary", "sh_test", "genrule", "alias"):
            ns[kind] = self.rule(kind)
        ns["exports_files"] = lambda *a, **k: None
        ns["package"] = lambda **k: None
        ns["package_group"] = lambda **k: None
        ns["glob"] = lambda include, **k: Glob(include)
        ns["fail"] = self.fail
        ns["select"] = lambda *a, **k: self.fail("select() is not supported by cmake/bazel_to_cmake.py")

        class Native:
            pass

        native = Native()
        for k, v in list(ns.items()):
            setattr(native, k, v)
        ns["native"] = native
        ns["load"] = lambda label, *syms, **aliases: self.load(ns, label, syms, aliases)
        return ns

    def fail(self, msg):
        raise SystemExit("%s/BUILD.bazel: %s" % (self.pkg, msg))

    def load(self, ns, label, syms, aliases):
        if label == "@rules_cc//cc:defs.bzl":
            return
        if label == "@libtorch//:config.bzl":
            values = {"HAS_TENSORPIPE_AGENT": self.has_agent, "HAS_CUDA": False}
        elif label.startswith(":") and label.endswith(".bzl"):
            values = self.namespace()
            path = os.path.join(ROOT, self.pkg, label[1:])
            exec(compile(open(path).read(), path, "exec"), values)
        else:
            self.fail("load(%r) is not known to cmake/bazel_to_cmake.py" % label)
        for s in syms:
            ns[s] = values[s]
        for alias, s in aliases.items():
            ns[alias] = values[s]


def evaluate(pkg, has_agent):
    p = Package(pkg, has_agent)
    path = os.path.join(ROOT, pkg, "BUILD.bazel")
    exec(compile(open(path).read(), path, "exec"), p.namespace())
    return p


def cmake_list(values):
    """One CMake argument per item; bracket arguments for anything with spaces or specials."""
    out = []
    for v in values:
        v = str(v)
        if re.fullmatch(r"[A-Za-z0-9_./:@+=,*-]+", v):
            out.append(v)
        else:
            out.append("[==[%s]==]" % v)
    return out


def emit_rule(p, kind, attrs, tags_without_agent):
    name = attrs["name"]
    lines = []

    def field(key, values):
        if values:
            lines.append("  %s %s" % (key, " ".join(cmake_list(values))))

    def files(values):
        out = []
        for v in [values] if isinstance(values, Glob) else values or []:
            if isinstance(v, Glob):
                out += ["glob:" + g for g in v.include]
            elif v.startswith(":") or v.startswith("//") or v.startswith("@"):
                out.append(p.label(v))
            else:
                out.append(v)
        return out

    fn = {"cc_library": "dtrain_cc_library", "cc_test": "dtrain_cc_test", "cc_binary": "dtrain_cc_binary",
          "sh_test": "dtrain_sh_test", "genrule": "dtrain_genrule", "alias": "dtrain_alias"}[kind]
    lines.append("%s(" % fn)
    field("NAME", [name])
    if kind == "alias":
        field("ACTUAL", [p.label(attrs["actual"])])
    field("SRCS", files(attrs.get("srcs")))
    field("HDRS", files(attrs.get("hdrs")))
    field("OUTS", attrs.get("outs"))
    field("DEPS", [p.label(d) for d in attrs.get("deps", [])])
    field("DATA", files(attrs.get("data")))
    field("COPTS", attrs.get("copts"))
    field("LINKOPTS", attrs.get("linkopts"))
    field("ENV", ["%s=%s" % kv for kv in sorted(attrs.get("env", {}).items())])
    tags = list(attrs.get("tags", []))
    if kind in ("cc_test", "sh_test"):
        field("SIZE", [attrs.get("size", "medium")])
        if "timeout" in attrs:
            field("TIMEOUT", [attrs["timeout"]])
    field("TAGS", tags)
    if tags != list(tags_without_agent):
        if "manual" not in tags_without_agent or "manual" in tags:
            p.fail("%s: tags that depend on @libtorch//:config.bzl other than 'manual' are not supported" % name)
        field("NEEDS", ["TENSORPIPE_AGENT"])
    if attrs.get("testonly"):
        lines.append("  TESTONLY")
    if attrs.get("alwayslink"):
        lines.append("  ALWAYSLINK")
    if "cmd" in attrs:
        # CMake splits arguments at ';': the command's are written as $<SEMICOLON>, which
        # dtrain_genrule's file(GENERATE) turns back.
        lines.append("  CMD [==[%s]==]" % attrs["cmd"].replace(";", "$<SEMICOLON>"))
    known = {"name", "srcs", "hdrs", "outs", "deps", "data", "copts", "linkopts", "env", "tags", "size",
             "timeout", "testonly", "alwayslink", "cmd", "actual", "visibility"}
    unknown = sorted(set(attrs) - known)
    if unknown:
        p.fail("%s: attributes %s are not supported by cmake/bazel_to_cmake.py" % (name, unknown))
    lines.append(")")
    return "\n".join(lines) + "\n"


def generate(pkg):
    with_agent = evaluate(pkg, True)
    without = evaluate(pkg, False)
    if [a["name"] for _, a in with_agent.rules] != [a["name"] for _, a in without.rules]:
        with_agent.fail("the targets defined depend on HAS_TENSORPIPE_AGENT; only their tags may")
    parts = [HEADER.format(pkg=pkg)]
    for (kind, attrs), (_, other) in zip(with_agent.rules, without.rules):
        parts.append(emit_rule(with_agent, kind, attrs, other.get("tags", [])))
    return "\n".join(parts)


def main(argv):
    check = "--check" in argv
    stale = []
    pkgs = packages()
    outputs = {os.path.join(pkg, "CMakeLists.txt"): generate(pkg) for pkg in pkgs}
    outputs["cmake/packages.cmake"] = (
        "# Generated by cmake/bazel_to_cmake.py: every package with a BUILD.bazel. Do not edit.\n" +
        "".join("dtrain_package(%s)\n" % pkg for pkg in pkgs))
    for rel, text in sorted(outputs.items()):
        path = os.path.join(ROOT, rel)
        old = open(path).read() if os.path.exists(path) else None
        if old == text:
            continue
        stale.append(rel)
        if not check:
            with open(path, "w") as f:
                f.write(text)
    if check and stale:
        print("bazel_to_cmake: stale or missing (run `python3 cmake/bazel_to_cmake.py` and commit): " +
              " ".join(stale), file=sys.stderr)
        return 1
    if not check:
        print("bazel_to_cmake: %d file(s) written, %d current" % (len(stale), len(outputs) - len(stale)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
