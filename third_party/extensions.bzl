"""Module extension for Bazel 7/8 users who depend on dtrain through MODULE.bazel (bzlmod).

It makes the one repository no registry has: LibTorch (LIBTORCH_HOME, default /usr), as WORKSPACE
does. Abseil, GoogleTest and Benchmark are registry modules (MODULE.bazel). Nothing is downloaded.
"""

load("//third_party:libtorch.bzl", "libtorch_repository")

def _system_impl(module_ctx):
    libtorch_repository(name = "libtorch")

system = module_extension(implementation = _system_impl)
