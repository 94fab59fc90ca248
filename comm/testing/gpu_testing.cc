#include "comm/testing/gpu_testing.h"

#include <cstdlib>

#include <torch/cuda.h>

#include "comm/process_group.h"

namespace dtrain::comm::testing {

std::string gpu_unavailable_reason() {
  if (!nccl_available()) {
    return "this dtrain was built against a CPU-only LibTorch (no libtorch_cuda.so); build the "
           "GPU suite with bench/gpu/build_bundle";
  }
  if (!torch::cuda::is_available()) {
    return "no CUDA device is visible (torch::cuda::is_available() is false)";
  }
  return "";
}

bool gpu_required() {
  const char* v = std::getenv("DTRAIN_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace dtrain::comm::testing
