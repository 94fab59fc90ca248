"""Writes checkpoints of PyTorch optimizers in the middle of training, and how Python continues.

Run at test time by optim/python_continuation_test.cc (nothing generated is checked in), with the
installed PyTorch (/usr/bin/python3, or $DTRAIN_PYTHON):

  python3 optim/testdata/make_continuation.py OUT_DIR

For every case in CASES it trains a few parameters for K steps with torch.optim (an LR scheduler
where the case asks), then saves with torch.save, as a user would:

  OUT_DIR/<case>.pt = {
      "optimizer": "<class name>",            # "Adam", "SGD", ...
      "model": {"p0": tensor, ...},           # the parameters after K steps
      "state_dict": opt.state_dict(),          # PyTorch's optimizer state after K steps
      "grads": [[g0, g1, ...], ...],           # the gradients of the next N steps
      "after": [p0, p1, ...],                  # the parameters after those N steps in Python
  }

A C++ reader loads the file, builds its optimizer over "model", loads "state_dict", feeds "grads"
and must end at "after".
"""
import inspect
import os
import sys

import torch

K = 3  # steps before the checkpoint
N = 3  # steps after it

# name -> (optimizer class, group options (one dict per param group), parameter shapes per
# group, dtype, scheduler?)
CASES = {
    "adam_one": ("Adam", [dict(lr=0.01)], [[(3,)]], torch.float32, False),
    "adam_many": ("Adam", [dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)], [[(4, 5), (7,), (1,), (2, 3)]],
                  torch.float32, False),
    "adam_amsgrad": ("Adam", [dict(lr=0.02, amsgrad=True)], [[(6,), (2, 2)]], torch.float32, False),
    "adam_two_groups": ("Adam", [dict(lr=0.01), dict(lr=0.03, weight_decay=0.2)], [[(5,)], [(3, 2), (4,)]],
                        torch.float32, False),
    "adam_scheduler": ("Adam", [dict(lr=0.05)], [[(4,), (3, 3)]], torch.float32, True),
    "adam_float64": ("Adam", [dict(lr=0.01)], [[(5,), (2, 4)]], torch.float64, False),
    "adamw": ("AdamW", [dict(lr=0.01, weight_decay=0.05)], [[(8,), (3,)]], torch.float32, False),
    "adamw_amsgrad_two_groups": ("AdamW", [dict(lr=0.01, amsgrad=True), dict(lr=0.002)], [[(4,)], [(5,)]],
                                 torch.float32, False),
    "sgd_momentum": ("SGD", [dict(lr=0.1, momentum=0.9)], [[(6,), (2, 3)]], torch.float32, False),
    "sgd_nesterov_one": ("SGD", [dict(lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.01)], [[(7,)]],
                         torch.float32, False),
    "sgd_dampening_scheduler": ("SGD", [dict(lr=0.2, momentum=0.5, dampening=0.3)], [[(3,), (4,)]],
                                torch.float32, True),
    "rmsprop_centered": ("RMSprop", [dict(lr=0.01, centered=True, momentum=0.5)], [[(5,), (2, 2)]],
                         torch.float32, False),
    "rmsprop_plain": ("RMSprop", [dict(lr=0.01, alpha=0.9)], [[(6,)]], torch.float64, False),
    "adagrad": ("Adagrad", [dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)], [[(5,), (3,)]],
                torch.float32, False),
    "adamax": ("Adamax", [dict(lr=0.02)], [[(4,), (2, 3)]], torch.float32, False),
    "adadelta": ("Adadelta", [dict(lr=1.0, rho=0.8)], [[(5,)]], torch.float32, False),
    "rprop": ("Rprop", [dict(lr=0.01)], [[(6,), (3,)]], torch.float32, False),
    # torch.optim's elementwise ones beyond torch.distributed.optim's (float32: PyTorch's
    # load_state_dict casts NAdam's and ASGD's float32 scalar state to the parameter's dtype, so a
    # float64 run continued after loading differs from one that never stopped, in PyTorch too).
    "nadam": ("NAdam", [dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)], [[(4,), (2, 3)]],
              torch.float32, False),
    "radam": ("RAdam", [dict(lr=0.01, weight_decay=0.05)], [[(5,), (3,)]], torch.float32, False),
    "asgd": ("ASGD", [dict(lr=0.05, t0=1.0)], [[(6,), (2, 2)]], torch.float32, False),
    # Built from named parameters (PyTorch 2.6+): every param group records "param_names".
    "adamw_named": ("AdamW", [dict(lr=0.01)], [[(4,), (3, 2)]], torch.float32, False),
    "sgd_named_two_groups": ("SGD", [dict(lr=0.1, momentum=0.9), dict(lr=0.05)], [[(5,)], [(2, 2)]],
                             torch.float32, False),
}
NAMED = {"adamw_named", "sgd_named_two_groups"}
# PyTorch 2.7+: Adam with decoupled weight decay (AdamW's update under Adam's name).
if "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters:
    CASES["adam_decoupled"] = ("Adam", [dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)],
                               [[(4,), (2, 3)]], torch.float32, False)


def run_case(name, spec, out_dir):
    cls_name, group_options, shapes, dtype, scheduler = spec
    torch.manual_seed(sum(map(ord, name)))
    groups = []
    params = []
    for options, group_shapes in zip(group_options, shapes):
        ps = [torch.randn(s, dtype=dtype).requires_grad_() for s in group_shapes]
        params += ps
        if name in NAMED:
            groups.append(dict(options, params=[("layer%d.weight" % (len(params) - len(ps) + i), p)
                                                for i, p in enumerate(ps)]))
        else:
            groups.append(dict(options, params=ps))
    opt = getattr(torch.optim, cls_name)(groups)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None

    def step():
        for p in params:
            p.grad = torch.randn(p.shape, dtype=dtype)
        opt.step()
        if sched is not None:
            sched.step()

    for _ in range(K):
        step()
    state = {
        "optimizer": cls_name,
        "model": {"p%d" % i: p.detach().clone() for i, p in enumerate(params)},
        "state_dict": opt.state_dict(),
    }
    torch.save(state, os.path.join(out_dir, name + ".pt"))  # before continuing: nothing aliases
    grads = []
    with torch.no_grad():
        for _ in range(N):
            gs = [torch.randn(p.shape, dtype=dtype) for p in params]
            grads.append(gs)
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()  # no scheduler step after the checkpoint: the C++ side keeps lr as loaded
    state = torch.load(os.path.join(out_dir, name + ".pt"))
    state["grads"] = grads
    state["after"] = [p.detach().clone() for p in params]
    torch.save(state, os.path.join(out_dir, name + ".pt"))


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    for name, spec in CASES.items():
        run_case(name, spec, out_dir)
    with open(os.path.join(out_dir, "cases.txt"), "w") as f:
        f.write("\n".join(CASES) + "\n")


if __name__ == "__main__":
    main()
