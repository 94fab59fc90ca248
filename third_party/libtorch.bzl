"""Repository rule exposing a LibTorch installation as @libtorch.

LIBTORCH_HOME (default /usr, Debian's libtorch-dev) names the prefix holding include/ and the
libraries. Only LibTorch's own include folders are linked into the repository: adding a system
prefix such as /usr/include as -isystem would break libstdc++'s #include_next wrappers.

Targets:
  @libtorch//:torch     LibTorch + c10d (Gloo; NCCL when CUDA is present)
  @libtorch//:tensorpipe_agent   adds USE_TENSORPIPE for the RPC agent headers
  @libtorch//:config.bzl  HAS_CUDA, LIBTORCH_HOME for BUILD files that branch on the backend
"""

_TORCH_INCLUDE_DIRS = ["ATen", "c10", "caffe2", "torch", "TH", "THCUDA", "c10d", "gloo", "tensorpipe", "pybind11", "kineto", "fmt"]

def _find_libdir(ctx, home):
    for sub in ["lib", "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu"]:
        if ctx.path(home + "/" + sub + "/libtorch_cpu.so").exists:
            return home + "/" + sub
    fail("LIBTORCH_HOME=%s has no libtorch_cpu.so under lib/, lib64/ or lib/<triplet>/; " % home +
         "install Debian's libtorch-dev (./bazelw does) or point LIBTORCH_HOME at an unpacked LibTorch.")

def _libtorch_repository_impl(ctx):
    home = ctx.os.environ.get("LIBTORCH_HOME", "/usr").rstrip("/")
    if home == "":
        home = "/"
    inc = home + "/include"
    if not ctx.path(inc + "/torch/csrc/api/include/torch/torch.h").exists:
        fail("LIBTORCH_HOME=%s: %s/torch/csrc/api/include/torch/torch.h not found; " % (home, inc) +
             "install libtorch-dev (./bazelw does) or set LIBTORCH_HOME to a LibTorch prefix.")
    libdir = _find_libdir(ctx, home)
    for d in _TORCH_INCLUDE_DIRS:
        p = ctx.path(inc + "/" + d)
        if p.exists:
            ctx.symlink(p, "include/" + d)
    has_cuda = ctx.path(libdir + "/libtorch_cuda.so").exists

    defines = ["USE_C10D_GLOO", "DTRAIN_HAS_NCCL=%d" % (1 if has_cuda else 0)]
    libs = ["-ltorch", "-ltorch_cpu", "-lc10"]
    if has_cuda:
        defines.append("USE_C10D_NCCL")
        libs = ["-ltorch", "-ltorch_cuda", "-ltorch_cpu", "-lc10_cuda", "-lc10"]
    system_lib = libdir in ["/usr/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64"]
    linkopts = ([] if system_lib else ["-L" + libdir, "-Wl,-rpath," + libdir]) + libs + ["-pthread"]

    ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "torch",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh"], allow_empty = True),
    includes = ["include", "include/torch/csrc/api/include"],
    defines = {defines},
    linkopts = {linkopts},
)

cc_library(
    name = "tensorpipe_agent",
    defines = ["USE_TENSORPIPE"],
    deps = [":torch"],
)

exports_files(["config.bzl"])
""".format(defines = repr(defines), linkopts = repr(linkopts)))
    ctx.file("config.bzl", "HAS_CUDA = {}\nLIBTORCH_HOME = {}\nLIBTORCH_LIBDIR = {}\n".format(
        "True" if has_cuda else "False",
        repr(home),
        repr(libdir),
    ))

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    environ = ["LIBTORCH_HOME"],
    local = True,
)
