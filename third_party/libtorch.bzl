"""Repository rule exposing a LibTorch installation as @libtorch.

LIBTORCH_HOME (default /usr, Debian's libtorch-dev) names the prefix holding include/ and the
libraries. Only LibTorch's own include folders are linked into the repository: adding a system
prefix such as /usr/include as -isystem would break libstdc++'s #include_next wrappers.

Targets:
  @libtorch//:torch     LibTorch + c10d (Gloo; NCCL when CUDA is present)
  @libtorch//:tensorpipe_agent   adds USE_TENSORPIPE for the RPC agent headers
  @libtorch//:config.bzl  HAS_CUDA, HAS_TENSORPIPE_AGENT, TORCH_VERSION, LIBTORCH_HOME for BUILD
                          files that branch on what the LibTorch found has
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

    # A pip wheel's torch/include has no Gloo headers (c10d's ProcessGroupGloo.hpp includes them):
    # Debian's libgloo-dev (in the root) provides them.
    if not ctx.path(inc + "/gloo").exists and ctx.path("/usr/include/gloo").exists:
        ctx.symlink("/usr/include/gloo", "include/gloo")
    has_cuda = ctx.path(libdir + "/libtorch_cuda.so").exists and not ctx.os.environ.get("DTRAIN_LIBTORCH_CPU_ONLY")

    # A CUDA LibTorch's c10d headers (ProcessGroupNCCL.hpp) include the CUDA runtime's and NCCL's:
    # CUDA_HOME (default /usr/local/cuda; ./bazelw mounts it into the root) provides them.
    cuda_home = ctx.os.environ.get("CUDA_HOME", "/usr/local/cuda").rstrip("/")
    if has_cuda:
        if not ctx.path(cuda_home + "/include/cuda_runtime.h").exists:
            fail("LIBTORCH_HOME=%s is a CUDA LibTorch (it has libtorch_cuda.so) but %s/include has no " % (home, cuda_home) +
                 "cuda_runtime.h: install the CUDA toolkit with NCCL, set CUDA_HOME to it, or set " +
                 "DTRAIN_LIBTORCH_CPU_ONLY=1 to build against its CPU libraries only.")
        ctx.symlink(cuda_home + "/include", "cuda_include")

    # The RPC agent (torch::distributed::rpc::TensorPipeAgent) is compiled into libtorch_cpu only
    # when LibTorch was built with USE_TENSORPIPE: pytorch.org's builds and Debian 13's 2.6 are,
    # Debian sid's 2.14 is not (its headers are there, the agent is not). rpc/ builds what needs it
    # only where it is.
    grep = ctx.execute(["grep", "-c", "TensorPipeAgent", libdir + "/libtorch_cpu.so"])
    has_tensorpipe_agent = grep.return_code == 0 and grep.stdout.strip() not in ["", "0"]
    version = ctx.execute(["sh", "-c", "sed -n 's/^#define TORCH_VERSION_\\(MAJOR\\|MINOR\\|PATCH\\) \\([0-9]*\\).*/\\2/p' " +
                                     inc + "/torch/headeronly/version.h " + inc + "/torch/csrc/api/include/torch/version.h 2>/dev/null | head -3 | paste -sd."])
    torch_version = version.stdout.strip()

    defines = ["USE_C10D_GLOO", "DTRAIN_HAS_NCCL=%d" % (1 if has_cuda else 0)]
    libs = ["-ltorch", "-ltorch_cpu", "-lc10"]
    if ctx.path(libdir + "/libtorch_cuda.so").exists and not has_cuda:
        # DTRAIN_LIBTORCH_CPU_ONLY with a CUDA LibTorch: its libtorch.so is a shim that needs
        # libtorch_cuda.so (and that cuFile, cuDNN...); the CPU libraries alone are enough.
        libs = ["-ltorch_cpu", "-lc10"]
    if has_cuda:
        defines.append("USE_C10D_NCCL")
        # --no-as-needed: nothing of dtrain's calls into libtorch_cuda directly, yet it must be
        # loaded for LibTorch to register its CUDA hooks (torch::cuda::is_available() is false
        # without it, and every CUDA tensor op fails).
        libs = ["-ltorch", "-Wl,--no-as-needed", "-ltorch_cuda", "-lc10_cuda", "-Wl,--as-needed", "-ltorch_cpu", "-lc10"]
    system_lib = libdir in ["/usr/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64"]
    if not system_lib:
        # PyPI's libtorch.so exports a copy of libstdc++'s std::filesystem (an older GCC's, 64
        # symbols, unversioned). Needed before libstdc++, it takes dtrain's calls too, and its
        # remove_all crashed (SIGSEGV) under g++ 16's libstdc++ (docs/libtorch.md). libstdc++ is
        # needed first, so that its own definitions win.
        libs = ["-Wl,--push-state,--no-as-needed", "-lstdc++", "-Wl,--pop-state"] + libs
    linkopts = ([] if system_lib else ["-L" + libdir, "-Wl,-rpath," + libdir]) + libs + ["-pthread"]
    if not system_lib:
        # A wheel's libraries need CUDA's (libcudart, libcupti even for libtorch_cpu; cuDNN,
        # cuSPARSELt, NVSHMEM... for libtorch_cuda), found at run time from the wheel's
        # nvidia-* packages or CUDA_HOME; the link does not insist on finding them all here.
        linkopts += ["-Wl,-rpath," + cuda_home + "/lib64", "-Wl,--allow-shlib-undefined"]

    ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "torch",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh", "cuda_include/**"], allow_empty = True),
    includes = ["include", "include/torch/csrc/api/include"] + {cuda_includes},
    defines = {defines},
    linkopts = {linkopts},
)

cc_library(
    name = "tensorpipe_agent",
    defines = ["USE_TENSORPIPE"],
    deps = [":torch"],
)

exports_files(["config.bzl"])
""".format(defines = repr(defines), linkopts = repr(linkopts), cuda_includes = repr(["cuda_include"] if has_cuda else [])))
    ctx.file("config.bzl", "HAS_CUDA = {}\nHAS_TENSORPIPE_AGENT = {}\nTORCH_VERSION = {}\nLIBTORCH_HOME = {}\nLIBTORCH_LIBDIR = {}\n".format(
        "True" if has_cuda else "False",
        "True" if has_tensorpipe_agent else "False",
        repr(torch_version),
        repr(home),
        repr(libdir),
    ))

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    environ = ["LIBTORCH_HOME", "CUDA_HOME", "DTRAIN_LIBTORCH_CPU_ONLY"],
    local = True,
)
