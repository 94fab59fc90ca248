// Test helpers shared by ZeroRedundancyOptimizer's tests: deterministic parameters and gradients
// (no global generator: rank threads would race on it), DDP-style averaged gradients, options.
//
//   std::vector<at::Tensor> p = dtrain::optim::testing::make_params(testing::kSizes);
//   testing::set_averaged_grads(group, p, step);   // collective
#ifndef DTRAIN_OPTIM_ZERO_TESTING_ZERO_TEST_UTIL_H_
#define DTRAIN_OPTIM_ZERO_TESTING_ZERO_TEST_UTIL_H_

#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/coalesced.h"
#include "comm/process_group.h"
#include "optim/zero/zero_redundancy_optimizer.h"
#include "testing/test_util.h"

namespace dtrain::optim::testing {

// Deterministic data without the global generator (rank threads would race on it).
inline std::vector<at::Tensor> make_params(const std::vector<int64_t>& sizes) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < sizes.size(); ++i) {
    out.push_back(
        at::cos(at::arange(sizes[i], at::kFloat) * 0.37 + static_cast<double>(i)).requires_grad_());
  }
  return out;
}
inline at::Tensor grad_for(const at::Tensor& p, int rank, int step, size_t i) {
  return at::sin(at::arange(p.numel(), at::kFloat) * (0.1 + 0.05 * rank) + step + 0.3 * i)
      .view(p.sizes());
}

// Each rank has its own gradients; DDP would average them: do that here.
inline void set_averaged_grads(comm::Group& g, std::vector<at::Tensor>& params, int step) {
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].requires_grad()) {
      params[i].mutable_grad() = at::Tensor();
      continue;
    }
    grads.push_back(grad_for(params[i], g.rank(), step, i));
  }
  comm::all_reduce_coalesced(g, grads).wait();
  size_t k = 0;
  for (auto& p : params) {
    if (p.requires_grad()) p.mutable_grad() = grads[k++].div_(g.size());
  }
}

inline std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

inline ZeroOptions zero_options(comm::Group& g, bool bucket_view) {
  ZeroOptions o;
  o.group = g;
  o.parameters_as_bucket_view = bucket_view;
  return o;
}

inline const std::vector<int64_t> kSizes = {9, 7, 5, 3, 40, 12, 1};

using test_util::expect_error;  // testing/test_util.h

}  // namespace dtrain::optim::testing

#endif  // DTRAIN_OPTIM_ZERO_TESTING_ZERO_TEST_UTIL_H_
