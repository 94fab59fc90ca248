"""dtrain_fuzz_target: one fuzz target (fuzz/fuzz_target.h), two runners."""

load("@rules_cc//cc:defs.bzl", "cc_binary", "cc_library", "cc_test")

def dtrain_fuzz_target(name, srcs, deps, size = "small"):
    """Defines NAME_test (mutation driver, in the suite) and NAME_libfuzzer (manual; clang only).

    Args:
      name: the target's name, e.g. "codec_fuzzer".
      srcs: the file defining LLVMFuzzerTestOneInput and dtrain::fuzz::seeds().
      deps: what it fuzzes.
      size: the test's size.
    """
    cc_library(
        name = name + "_target",
        testonly = True,
        srcs = srcs,
        deps = deps + [":fuzz_target"],
        alwayslink = True,
    )
    cc_test(
        name = name + "_test",
        size = size,
        srcs = ["mutation_driver.cc"],
        deps = [name + "_target", ":fuzz_target"],
    )

    # Coverage-guided: fuzz/run_libfuzzer NAME SECONDS builds this with clang (--config=libfuzzer).
    cc_binary(
        name = name + "_libfuzzer",
        testonly = True,
        linkopts = ["-fsanitize=fuzzer"],
        tags = ["manual"],
        deps = [name + "_target"],
    )
