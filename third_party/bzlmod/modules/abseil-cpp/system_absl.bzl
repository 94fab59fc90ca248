"""Repository rule exposing Debian's libabsl-dev (@abseil_system_libs; the stand-in module aliases it).

system.BUILD lists, per target, the -labsl_* libraries of every Abseil this build
supports (Debian 12's 20220623, Debian 13's 20240722). Abseil splits and renames its shared
libraries between releases (20240722 adds libabsl_string_view, for example), so this rule keeps
the -labsl_X options whose libabsl_X.so exists on the system and drops the others.
"""

_LIBDIRS = ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"]

def _exists(ctx, lib):
    for d in _LIBDIRS:
        if ctx.path(d + "/lib" + lib + ".so").exists:
            return True
    return False

def _system_absl_impl(ctx):
    template = ctx.read(ctx.path(ctx.attr.build_file))
    out = []
    for line in template.split("\n"):
        # Drop quoted "-labsl_X" entries whose library is missing.
        pieces = line.split('"-labsl_')
        if len(pieces) > 1:
            rebuilt = pieces[0]
            for p in pieces[1:]:
                name, rest = p.split('"', 1)
                if _exists(ctx, "absl_" + name):
                    rebuilt += '"-labsl_' + name + '"' + rest
                else:
                    rebuilt += rest.lstrip(",").lstrip(" ") if rest.startswith(",") else rest
            line = rebuilt
        out.append(line)
    ctx.file("BUILD.bazel", "\n".join(out))

system_absl_repository = repository_rule(
    implementation = _system_absl_impl,
    attrs = {"build_file": attr.label(allow_single_file = True)},
    local = True,
)
