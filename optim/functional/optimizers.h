// Functional optimizers, numerically PyTorch's single-tensor implementations: the eight of
// torch.distributed.optim (SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, RMSprop, Rprop) and
// torch.optim's NAdam, RAdam, ASGD, Adafactor, SparseAdam (sparse gradients) and Muon (2-D
// parameters).
// Options mirror PyTorch's keyword arguments and defaults, in LibTorch's chainable style.
//
//   using namespace dtrain::optim;
//   FunctionalSGD sgd(params, SGDOptions(0.1).momentum(0.9).nesterov(true));
//   FunctionalAdamW adamw(params, AdamWOptions().lr(3e-4).betas({0.9, 0.95}));
//   adamw.step(grads);                               // one optional gradient per parameter
//   adamw.set_options(AdamWOptions(adamw.options()).weight_decay(0.05));  // validated as at construction
//
// Each is TypedFunctionalOptimizer<ItsOptions> (options.h), declared in its own <name>.h and
// described in <name>.cc, and listed once, in builtin.bzl: its option table (keys, PyTorch's
// checks, the registry's defaults), its state layout and its kernels. An empty parameter list is
// an error unless the constructor's allow_empty_param_list (PyTorch's _allow_empty_param_list).
//
// Contiguous float32/float64 parameters take a fused path where the update is elementwise (all
// but Adafactor, SparseAdam and Muon): one multi-threaded pass per element over parameter,
// gradient and state for all parameters at once; other layouts and dtypes, and those three, run
// PyTorch's sequence of ATen operations.
//
// Adding an optimizer: docs/ARCHITECTURE.md, "Where does my change go", item 1 (the one recipe).
#ifndef DTRAIN_OPTIM_FUNCTIONAL_OPTIMIZERS_H_
#define DTRAIN_OPTIM_FUNCTIONAL_OPTIMIZERS_H_

#include "optim/functional/builtin_optimizers.h"  // generated: every built-in's header
#include "optim/functional/options.h"

#endif  // DTRAIN_OPTIM_FUNCTIONAL_OPTIMIZERS_H_
