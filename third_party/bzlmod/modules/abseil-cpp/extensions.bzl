"""The system Abseil as @abseil_system_libs, for the stand-in module (bzlmod only)."""

load("//:system_absl.bzl", "system_absl_repository")

def _system_impl(module_ctx):
    system_absl_repository(name = "abseil_system_libs", build_file = Label("//:system.BUILD"))

system = module_extension(implementation = _system_impl)
