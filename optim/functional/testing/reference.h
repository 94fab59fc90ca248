// Reader for the reference trajectories written by optim/functional/testdata/make_reference.py (testonly).
//
//   auto cases = dtrain::optim::testing::read_reference("optim/functional/testdata/adam.ref");
//   for (const auto& c : cases) { c.options; c.init[i]; c.grad(step, i, at::kFloat); c.params64[step][i]; }
#ifndef DTRAIN_OPTIM_FUNCTIONAL_TESTING_REFERENCE_H_
#define DTRAIN_OPTIM_FUNCTIONAL_TESTING_REFERENCE_H_

#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "optim/functional/optimizer.h"

namespace dtrain::optim::testing {

// One entry of PyTorch's optimizer state after the last step (float64 run).
struct StateValue {
  int param = 0;
  std::string key;
  std::string kind;  // the value's type in PyTorch: "float32", "float64" (tensors), "int"
  at::Tensor value;  // flattened, float64; undefined for None
};

struct ReferenceCase {
  std::string name;
  OptionsDict options = new_options_dict();
  std::vector<std::vector<int64_t>> shapes;
  int64_t sparse_dim = 0;  // > 0: gradients reach the optimizer as g.to_sparse(sparse_dim)
  int steps = 0;
  std::vector<std::vector<bool>> missing;         // [step][param]
  std::vector<at::Tensor> init;                   // float64
  std::vector<std::vector<at::Tensor>> grads;     // [step][param], float64
  std::vector<std::vector<at::Tensor>> params64;  // [step][param] after the step
  std::vector<std::vector<at::Tensor>> params32;  // float32 run, stored as float64
  std::vector<StateValue> final_state;

  // The gradient of `param` at `step` in `dtype` as the optimizer takes it (undefined where
  // missing, sparse COO for a sparse_grads case).
  at::Tensor grad(int step, size_t param, at::ScalarType dtype) const;
};

// Reads every case of one file; throws c10::Error naming the file on a malformed one.
std::vector<ReferenceCase> read_reference(const std::string& path);

// max |a - b| / max |b| (norm-wise relative error), 0 when both are all zeros.
double relative_error(const at::Tensor& a, const at::Tensor& b);

// Parameter layouts the parity tests run: contiguous (the fused kernels) and strided (a
// non-contiguous view: the ATen path).
enum class Layout { kContiguous, kStrided };

// A parameter holding `init` in `dtype`, laid out as `layout`.
at::Tensor make_param(const at::Tensor& init, at::ScalarType dtype, Layout layout);

// An options dict from {key, value} pairs, for tests that build optimizers by name.
OptionsDict options_dict(const std::vector<std::pair<const char*, c10::IValue>>& kv);

}  // namespace dtrain::optim::testing

#endif  // DTRAIN_OPTIM_FUNCTIONAL_TESTING_REFERENCE_H_
