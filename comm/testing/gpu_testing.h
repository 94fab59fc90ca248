// GPU tests (testonly). A test target tagged "gpu" runs its cases only where a CUDA device is
// visible: elsewhere each case is skipped with the reason printed, and with DTRAIN_REQUIRE_GPU=1
// (set by bench/gpu/run_on_gpu, the GPU machine's runner) each case fails instead, so a GPU run
// that silently skipped everything cannot look green.
//
//   TEST(NcclTest, AllReduces) {
//     DTRAIN_GPU_TEST_OR_SKIP();
//     at::Tensor t = at::ones({4}, at::Device(at::kCUDA, 0));
//     ...
//   }
//
// CI builds the gpu-tagged targets and leaves them out of its run (--test_tag_filters=-gpu).
#ifndef DTRAIN_COMM_TESTING_GPU_TESTING_H_
#define DTRAIN_COMM_TESTING_GPU_TESTING_H_

#include <string>

#include <gtest/gtest.h>

namespace dtrain::comm::testing {

// Empty when this build has CUDA and a CUDA device is visible; otherwise why not, as one line.
std::string gpu_unavailable_reason();

// True when DTRAIN_REQUIRE_GPU=1: a missing GPU is a failure, not a skip.
bool gpu_required();

}  // namespace dtrain::comm::testing

#define DTRAIN_GPU_TEST_OR_SKIP()                                                           \
  if (const std::string dtrain_gpu_why = ::dtrain::comm::testing::gpu_unavailable_reason(); \
      !dtrain_gpu_why.empty()) {                                                            \
    if (::dtrain::comm::testing::gpu_required()) {                                          \
      FAIL() << "DTRAIN_REQUIRE_GPU=1 but " << dtrain_gpu_why;                              \
    }                                                                                       \
    GTEST_SKIP() << dtrain_gpu_why;                                                         \
  }

#endif  // DTRAIN_COMM_TESTING_GPU_TESTING_H_
