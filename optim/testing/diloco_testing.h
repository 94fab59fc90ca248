// Helpers the DiLoCo tests share (optim/diloco_test.cc, optim/diloco_streaming_test.cc): copies of
// parameters, the largest difference, a list of tensors from a reference file, a state dict with
// one "diloco" entry replaced or removed.
//
//   std::vector<at::Tensor> p = dtrain::optim::diloco_testing::fresh(init);
//   c10::IValue bad = dtrain::optim::diloco_testing::with_entry(sd, "steps", c10::IValue(-1));
#ifndef DTRAIN_OPTIM_TESTING_DILOCO_TESTING_H_
#define DTRAIN_OPTIM_TESTING_DILOCO_TESTING_H_

#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

namespace dtrain::optim::diloco_testing {

// Leaf copies of `init` that require grad.
inline std::vector<at::Tensor> fresh(const std::vector<at::Tensor>& init) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : init) out.push_back(t.detach().clone().requires_grad_());
  return out;
}

inline double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.detach().to(at::kDouble) - b.detach().to(at::kDouble)).abs().max().item<double>();
}

// The tensors of a List[Tensor] IValue (a reference file's entry).
inline std::vector<at::Tensor> tensors(const c10::IValue& list) {
  std::vector<at::Tensor> out;
  for (const auto& t : list.toList()) out.push_back(t.get().toTensor());
  return out;
}

// `sd` (a DiLoCo state dict) with its "diloco" entry `key` set to `value`, or removed (nullopt).
inline c10::IValue with_entry(const c10::IValue& sd, const std::string& key,
                              const std::optional<c10::IValue>& value) {
  c10::impl::GenericDict top = sd.toGenericDict().copy();
  c10::impl::GenericDict d = top.at("diloco").toGenericDict().copy();
  if (value.has_value()) {
    d.insert_or_assign(key, *value);
  } else {
    (void)d.erase(key);
  }
  top.insert_or_assign("diloco", d);
  return top;
}

}  // namespace dtrain::optim::diloco_testing

#endif  // DTRAIN_OPTIM_TESTING_DILOCO_TESTING_H_
