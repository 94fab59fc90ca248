// Reader for the reference trajectories written by optim/testdata/make_reference.py (testonly).
//
//   auto cases = dtrain::optim::testing::read_reference("optim/testdata/adam.ref");
//   for (const auto& c : cases) { c.options; c.init[i]; c.grads[step][i]; c.params64[step][i]; }
#ifndef DTRAIN_OPTIM_REFERENCE_TESTING_H_
#define DTRAIN_OPTIM_REFERENCE_TESTING_H_

#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "optim/functional_optimizer.h"

namespace dtrain::optim::testing {

struct ReferenceCase {
  std::string name;
  OptionsDict options = new_options_dict();
  std::vector<std::vector<int64_t>> shapes;
  int steps = 0;
  std::vector<std::vector<bool>> missing;              // [step][param]
  std::vector<at::Tensor> init;                        // float64
  std::vector<std::vector<at::Tensor>> grads;          // [step][param], float64
  std::vector<std::vector<at::Tensor>> params64;       // [step][param] after the step
  std::vector<std::vector<at::Tensor>> params32;       // float32 run, stored as float64
  // Final state of the float64 run: (param, key) -> value (undefined tensor for None).
  std::vector<std::pair<std::pair<int, std::string>, at::Tensor>> final_state;
};

// Reads every case of one file; throws c10::Error naming the file on a malformed one.
std::vector<ReferenceCase> read_reference(const std::string& path);

// max |a - b| / max |b| (norm-wise relative error), 0 when both are all zeros.
double relative_error(const at::Tensor& a, const at::Tensor& b);

}  // namespace dtrain::optim::testing

#endif  // DTRAIN_OPTIM_REFERENCE_TESTING_H_
