# What dtrain's CMake build takes from the system: LibTorch through find_package(Torch) (a pip
# wheel: CMAKE_PREFIX_PATH=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)'); a
# pytorch.org zip: its libtorch/; a distribution's libtorch-dev: found as is), Abseil, GoogleTest
# and Google Benchmark through their CMake packages. Nothing is downloaded. The Bazel twins of these
# are third_party/libtorch.bzl and the registry modules (third_party/bzlmod/modules);
# dtrain_external() maps their labels.

find_package(Torch REQUIRED)
find_package(absl REQUIRED)
find_package(Threads REQUIRED)
if(BUILD_TESTING)
  find_package(GTest REQUIRED)
endif()
if(DTRAIN_BENCHMARKS OR BUILD_TESTING)
  find_package(benchmark REQUIRED)
endif()

# The library folder of the LibTorch found (TorchConfig.cmake names its libraries by path).
find_library(DTRAIN_TORCH_CPU_LIBRARY torch_cpu HINTS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED)
get_filename_component(DTRAIN_TORCH_LIBDIR "${DTRAIN_TORCH_CPU_LIBRARY}" DIRECTORY)

# The RPC agent is in libtorch_cpu only when LibTorch was built with TensorPipe (pytorch.org's and
# PyPI's builds, Debian 13's 2.6; not Debian sid's 2.14): what needs it is built only where it is,
# as third_party/libtorch.bzl decides for Bazel.
execute_process(COMMAND grep -c TensorPipeAgent "${DTRAIN_TORCH_CPU_LIBRARY}" OUTPUT_VARIABLE _agent
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(_agent AND NOT _agent STREQUAL "0")
  set(DTRAIN_HAS_TENSORPIPE_AGENT ON)
else()
  set(DTRAIN_HAS_TENSORPIPE_AGENT OFF)
endif()
if(EXISTS "${DTRAIN_TORCH_LIBDIR}/libtorch_cuda.so" AND NOT DTRAIN_LIBTORCH_CPU_ONLY)
  set(DTRAIN_HAS_CUDA ON)
else()
  set(DTRAIN_HAS_CUDA OFF)
endif()

# c10d's headers include Gloo's; a wheel's include/ has none: take the system's (Debian's
# libgloo-dev) or DTRAIN_GLOO_INCLUDE_DIR.
find_path(DTRAIN_GLOO_INCLUDE_DIR gloo/config.h HINTS ${TORCH_INCLUDE_DIRS}
          DOC "the folder holding gloo/ (Debian: libgloo-dev)")
if(NOT DTRAIN_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "dtrain: Gloo's headers (gloo/config.h) are neither in LibTorch's include/ nor on "
                      "the system: install libgloo-dev (Debian) or set DTRAIN_GLOO_INCLUDE_DIR.")
endif()

# @libtorch//:torch: LibTorch with c10d (Gloo; NCCL with a CUDA LibTorch), as the Bazel rule makes it.
add_library(dtrain_torch INTERFACE)
target_link_libraries(dtrain_torch INTERFACE torch ${TORCH_LIBRARIES} Threads::Threads)
target_compile_definitions(dtrain_torch INTERFACE USE_C10D_GLOO DTRAIN_HAS_NCCL=$<BOOL:${DTRAIN_HAS_CUDA}>
                           $<$<BOOL:${DTRAIN_HAS_CUDA}>:USE_C10D_NCCL>)
if(NOT DTRAIN_GLOO_INCLUDE_DIR IN_LIST TORCH_INCLUDE_DIRS)
  target_include_directories(dtrain_torch SYSTEM INTERFACE "$<BUILD_INTERFACE:${DTRAIN_GLOO_INCLUDE_DIR}>")
endif()
add_library(dtrain_tensorpipe_agent INTERFACE)
target_compile_definitions(dtrain_tensorpipe_agent INTERFACE USE_TENSORPIPE)
target_link_libraries(dtrain_tensorpipe_agent INTERFACE dtrain_torch)

# A LibTorch outside the system's folders (a wheel, a zip), as third_party/libtorch.bzl links it:
# libstdc++ needed first (a wheel's libtorch.so exports an older std::filesystem that would take
# dtrain's calls: docs/libtorch.md), and a CUDA build's NVIDIA libraries left to be found at run
# time (a wheel gets them from its nvidia-* packages).
if(NOT DTRAIN_TORCH_LIBDIR MATCHES "^/usr/lib(64)?(/[a-z0-9_]+-linux-gnu)?$")
  target_link_options(dtrain_torch INTERFACE "LINKER:--push-state,--no-as-needed" "LINKER:-lstdc++"
                      "LINKER:--pop-state" "LINKER:--allow-shlib-undefined")
endif()
# DTRAIN_TEST_ENV: K=V;... added to every test's environment (e.g. LD_LIBRARY_PATH for a CUDA
# wheel's libraries on a machine without them: .ci/cmake_wheel).
set(DTRAIN_TEST_ENV "" CACHE STRING "K=V;... added to every test's environment")

dtrain_external(@libtorch//:torch dtrain_torch)
dtrain_external(@libtorch//:tensorpipe_agent dtrain_tensorpipe_agent)
dtrain_external(@abseil-cpp//absl/status absl::status)
dtrain_external(@abseil-cpp//absl/status:statusor absl::statusor)
dtrain_external(@abseil-cpp//absl/strings absl::strings)
dtrain_external(@abseil-cpp//absl/strings:str_format absl::str_format)
dtrain_external(@abseil-cpp//absl/flags:config absl::flags_config)
dtrain_external(@abseil-cpp//absl/flags:flag absl::flags)
dtrain_external(@abseil-cpp//absl/flags:parse absl::flags_parse)
dtrain_external(@abseil-cpp//absl/flags:reflection absl::flags_reflection)
dtrain_external(@abseil-cpp//absl/flags:usage absl::flags_usage)
dtrain_external(@googletest//:gtest GTest::gtest GTest::gmock)
dtrain_external(@googletest//:gtest_main GTest::gtest_main GTest::gmock)
dtrain_external(@google_benchmark//:benchmark benchmark::benchmark)

# Tests that compare against PyTorch run the Python beside the LibTorch (/usr/bin/python3, as the
# Bazel genrules do): their oracle genrules are built only where it imports torch.
execute_process(COMMAND /usr/bin/python3 -c "import torch" RESULT_VARIABLE _no_torch_python
                OUTPUT_QUIET ERROR_QUIET)
if(_no_torch_python EQUAL 0)
  set(DTRAIN_PYTORCH_ORACLE ON)
else()
  set(DTRAIN_PYTORCH_ORACLE OFF)
endif()
message(STATUS "dtrain: LibTorch ${Torch_VERSION} in ${DTRAIN_TORCH_LIBDIR}; CUDA ${DTRAIN_HAS_CUDA}; "
               "TensorPipe agent ${DTRAIN_HAS_TENSORPIPE_AGENT}; PyTorch oracle ${DTRAIN_PYTORCH_ORACLE}")
