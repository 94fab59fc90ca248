// optim/'s LibTorch version layer: the one file in optim/ that depends on which LibTorch it is
// built against (docs/libtorch.md; 1.13 was retired after commit d5a9c1f).
//
// torch::optim::Optimizer::state() is keyed by the parameter's TensorImpl address (`void*`).
// `param_state_key` gives the key, so that callers never spell the key type.
//
//   auto it = optimizer.state().find(dtrain::optim::param_state_key(p));
//
// ATen's fused multi-tensor optimizer kernels, called as PyTorch's torch/optim/*.py `_fused_*`
// functions call them (grad_scale and found_inf undefined, lr a double), through one wrapper each,
// so that a signature change between releases is fixed here. The double-lr overloads (a Tensor-lr
// one exists beside each), as ATen/ops/*.h of 2.11 and 2.14 declare them; 2.6 has the same ones
// (ops added in 2.0 to 2.4):
//   at::_fused_adam_ / at::_fused_adamw_(TensorList self, grads, exp_avgs, exp_avg_sqs,
//       max_exp_avg_sqs, state_steps, double lr, double beta1, double beta2, double weight_decay,
//       double eps, bool amsgrad, bool maximize, optional<Tensor> grad_scale = {}, found_inf = {})
//   at::_fused_sgd_(TensorList self, grads, momentum_buffer_list, double weight_decay,
//       double momentum, double lr, double dampening, bool nesterov, bool maximize,
//       bool is_first_step, optional<Tensor> grad_scale = {}, found_inf = {})
//   at::_fused_adagrad_(TensorList self, grads, state_sums, state_steps, double lr,
//       double lr_decay, double weight_decay, double eps, bool maximize,
//       optional<Tensor> grad_scale = {}, found_inf = {})   a CUDA kernel in 2.11 and 2.14, CPU only in 2.6
// Where an op has no CUDA kernel (has_cuda_kernel: _fused_adagrad_ in 2.6) the callers take the
// _foreach_ ops instead.
//
//   if (dtrain::optim::has_cuda_kernel("aten::_fused_adagrad_")) dtrain::optim::fused_adagrad_(...);
#ifndef DTRAIN_OPTIM_FUNCTIONAL_LIBTORCH_COMPAT_H_
#define DTRAIN_OPTIM_FUNCTIONAL_LIBTORCH_COMPAT_H_

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_fused_adagrad.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <torch/version.h>

namespace dtrain::optim {

// PyTorch 2.7 gave Adam a `decoupled_weight_decay` option and made AdamW an Adam with it on
// (both param_groups carry the key since); 2.6's have none.
inline constexpr bool kAdamHasDecoupledWeightDecay = TORCH_VERSION_MAJOR > 2 ||
                                                     (TORCH_VERSION_MAJOR == 2 &&
                                                      TORCH_VERSION_MINOR >= 7);

inline void* param_state_key(const at::Tensor& p) { return p.unsafeGetTensorImpl(); }

// Whether this LibTorch registered a CUDA kernel for the operator `name` (its default overload):
// false for _fused_adagrad_ in 2.6 (CPU only there), and for everything in a LibTorch built
// without CUDA. Looked up in the dispatcher, so it is right whichever LibTorch is loaded.
inline bool has_cuda_kernel(const char* name) {
  const auto handle = c10::Dispatcher::singleton().findSchema(c10::OperatorName(name, ""));
  return handle.has_value() && handle->hasKernelForDispatchKey(c10::DispatchKey::CUDA);
}

// at::_fused_adamw_ when `decoupled` (AdamW), else at::_fused_adam_. max_exp_avg_sqs is empty
// unless amsgrad; state_steps are float32 tensors on the parameters' device.
inline void fused_adam_(bool decoupled, at::TensorList params, at::TensorList grads,
                        at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                        at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr,
                        double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                        bool maximize) {
  if (decoupled) {
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1,
                      beta2, weight_decay, eps, amsgrad, maximize);
  } else {
    at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1,
                     beta2, weight_decay, eps, amsgrad, maximize);
  }
}

// at::_fused_sgd_: momentum_buffer_list empty when momentum == 0; is_first_step: every buffer of
// the call is new (filled with the gradient).
inline void fused_sgd_(at::TensorList params, at::TensorList grads,
                       at::TensorList momentum_buffer_list, double weight_decay, double momentum,
                       double lr, double dampening, bool nesterov, bool maximize,
                       bool is_first_step) {
  at::_fused_sgd_(params, grads, momentum_buffer_list, weight_decay, momentum, lr, dampening,
                  nesterov, maximize, is_first_step);
}

// at::_fused_adagrad_ (CUDA only where has_cuda_kernel("aten::_fused_adagrad_")).
inline void fused_adagrad_(at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                           at::TensorList state_steps, double lr, double lr_decay,
                           double weight_decay, double eps, bool maximize) {
  at::_fused_adagrad_(params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps,
                      maximize);
}

}  // namespace dtrain::optim

#endif  // DTRAIN_OPTIM_FUNCTIONAL_LIBTORCH_COMPAT_H_
