// The contract every dtrain fuzz target keeps, so that one source file serves two runners:
//
//   - libFuzzer (clang, coverage-guided): `fuzz/run_libfuzzer NAME SECONDS` links the target with
//     -fsanitize=fuzzer,address,undefined and runs it on a corpus started from the target's seeds;
//   - fuzz/mutation_driver.cc (any compiler, no coverage): the `NAME_test` targets in //fuzz run
//     the seeds and then random byte-level mutations of them for DTRAIN_FUZZ_SECONDS (default 10 s)
//     in the ordinary test suite, and under --config=asan.
//
// A target defines both functions below. LLVMFuzzerTestOneInput must return 0 for every input;
// the failures it exists to find are crashes, aborts (an uncaught exception included) and, under
// the sanitizers, out-of-bounds reads and undefined behaviour. It may also abort on purpose
// (DTRAIN_FUZZ_CHECK) when an input breaks a stated guarantee, e.g. a Status-returning reader
// that throws.
#ifndef DTRAIN_FUZZ_FUZZ_TARGET_H_
#define DTRAIN_FUZZ_FUZZ_TARGET_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace dtrain::fuzz {

// Valid inputs the mutations start from (each should reach deep into the code under test).
std::vector<std::string> seeds();

// Optional: tokens of the input's format (opcodes, magic numbers, names) that the mutation
// driver inserts as whole pieces. A target without one gets an empty dictionary (a weak default
// in mutation_driver.cc); libFuzzer finds such tokens itself from comparisons.
std::vector<std::string> dictionary();

}  // namespace dtrain::fuzz

// Aborts with a message when `cond` is false: a broken guarantee, reported as a crash.
#define DTRAIN_FUZZ_CHECK(cond, what)                                                         \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "fuzz target: guarantee broken: %s\n", std::string(what).c_str()); \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

#endif  // DTRAIN_FUZZ_FUZZ_TARGET_H_
