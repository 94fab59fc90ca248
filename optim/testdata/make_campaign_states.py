"""Writes the real optimizer states the hostile state-dict campaign mutates.

Run at test time by optim/state_dict_campaign_test.cc (nothing generated is checked in), with the
installed PyTorch (/usr/bin/python3, or $DTRAIN_PYTHON):

  python3 optim/testdata/make_campaign_states.py OUT_DIR

For every case in CASES that the installed PyTorch has (Muon needs 2.9+, Adafactor 2.5+), it trains
a few parameters for two steps with torch.optim and saves, as a user would:

  OUT_DIR/<case>.pt = {
      "optimizer": "<class name>",        # "Adam", "SGD", ...
      "model": {"p0": tensor, ...},       # the parameters after the two steps
      "state_dict": opt.state_dict(),      # PyTorch's optimizer state then
      "missing_options": {key: {"accepted": bool, "value": v}},   # see missing_options()
  }
  OUT_DIR/cases.txt                        # the cases written, one a line

The C++ test makes each hostile variant from these (a NaN, a wrong shape, a string step, ...).
"""
import copy
import os
import sys

import torch

# name -> (optimizer class, options, parameter shapes)
CASES = {
    "adam": ("Adam", dict(lr=0.01), [(3, 4), (5,), (2, 3)]),
    "adam_amsgrad": ("Adam", dict(lr=0.01, amsgrad=True), [(4,), (2, 2)]),
    "adamw": ("AdamW", dict(lr=0.01, weight_decay=0.1), [(3, 4), (5,)]),
    "sgd_momentum": ("SGD", dict(lr=0.1, momentum=0.9), [(3, 4), (5,), (2,)]),
    "rmsprop": ("RMSprop", dict(lr=0.01, momentum=0.5, centered=True), [(3, 4), (5,)]),
    "adagrad": ("Adagrad", dict(lr=0.1), [(3, 4), (5,)]),
    "adafactor": ("Adafactor", dict(lr=0.01), [(3, 4), (5,)]),
    "muon": ("Muon", dict(lr=0.01), [(3, 4), (4, 2)]),
}


def missing_options(cls, options, shapes, state_dict):
    """For each option of the group: does PyTorch load and step a state dict without it, and what
    value does its load give the option then (its __setstate__'s setdefault)?"""
    out = {}
    for key in state_dict["param_groups"][0]:
        if key in ("params", "param_names"):
            continue
        params = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
        opt = cls(params, **options)
        edited = copy.deepcopy(state_dict)
        del edited["param_groups"][0][key]
        try:
            opt.load_state_dict(edited)
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
            out[key] = {"accepted": True, "value": opt.param_groups[0][key]}
        except KeyError:
            out[key] = {"accepted": False, "value": None}
    return out


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, (cls_name, options, shapes) in CASES.items():
        cls = getattr(torch.optim, cls_name, None)
        if cls is None:
            print(f"make_campaign_states: torch {torch.__version__} has no {cls_name}", file=sys.stderr)
            continue
        torch.manual_seed(sum(map(ord, name)))
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        opt = cls(params, **options)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        torch.save({"optimizer": cls_name,
                    "model": {f"p{i}": p.detach().clone() for i, p in enumerate(params)},
                    "state_dict": opt.state_dict(),
                    "missing_options": missing_options(cls, options, shapes, opt.state_dict())},
                   os.path.join(out_dir, name + ".pt"))
        written.append(name)
    with open(os.path.join(out_dir, "cases.txt"), "w") as f:
        f.write("\n".join(written) + "\n")


if __name__ == "__main__":
    main()
