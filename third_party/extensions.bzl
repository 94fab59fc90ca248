"""Module extension for Bazel 7/8 users who depend on dtrain through MODULE.bazel (bzlmod).

It makes the same local repositories as WORKSPACE, over the installed packages and files in this
tree: LibTorch (LIBTORCH_HOME, default /usr), the system Abseil, GoogleTest and Benchmark. Nothing
is downloaded.
"""

load("@bazel_tools//tools/build_defs/repo:local.bzl", "new_local_repository")
load("//third_party:libtorch.bzl", "libtorch_repository")
load("//third_party:system_absl.bzl", "system_absl_repository")

def _system_impl(module_ctx):
    libtorch_repository(name = "libtorch")
    system_absl_repository(name = "com_google_absl", build_file = Label("//third_party:absl.BUILD"))
    new_local_repository(
        name = "com_google_googletest",
        build_file = Label("//third_party:googletest.BUILD"),
        path = str(module_ctx.path(Label("//third_party:system/README")).dirname),
    )
    new_local_repository(
        name = "com_github_google_benchmark",
        build_file = Label("//third_party:benchmark.BUILD"),
        path = str(module_ctx.path(Label("//third_party:system/README")).dirname),
    )

system = module_extension(implementation = _system_impl)
