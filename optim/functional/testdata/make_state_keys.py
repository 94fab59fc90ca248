#!/usr/bin/python3
"""Writes what the installed PyTorch puts in an optimizer's state_dict: every param_group key
with its value, and every state entry with its kind and shape, for each optimizer dtrain has (the
14 built-ins; SGD, Adam, AdamW, Adagrad and RMSprop are also LibTorch's twins). state_keys_test
compares dtrain's state dicts with it key by key, for the PyTorch beside the LibTorch being built
(2.14 in the Debian sid root, 2.6 in the Debian 13 one): BUILD's installed_pytorch_state_keys
genrule runs it at build time, so the file is never checked in.

    ./bazelw --exec /usr/bin/python3 optim/functional/testdata/make_state_keys.py OUT_FILE

Each case builds the optimizer on float64 parameters, gives every parameter but the last a
gradient for STEPS steps (the last never gets one: no state, except where PyTorch makes state at
construction) and writes its state_dict. File format (text):
    dtrain-state-keys 1
    torch VERSION
    absent NAME                  (an optimizer this PyTorch lacks: Muon before 2.9)
    case NAME                    (then the case's lines, up to "end")
    options key=value ...        (the constructor's arguments, as make_reference.py writes them)
    shapes 3,4 5 2,3             (the parameters; "scalar" for a 0-dim one)
    sparse_grads 1               (gradients passed as g.to_sparse(1))
    steps 2
    group KEY VALUE              (one per param_group key but "params", in PyTorch's order)
    state PARAM KEY KIND SHAPE   (one per state entry, in PyTorch's order; KIND a tensor's dtype
                                  (float32, float64) or a Python type (int, float, NoneType);
                                  SHAPE a tensor's, "scalar" for 0-dim, "-" for a non-tensor)
    end
VALUE as make_reference.py's options: floats as repr(float) (ints too: 0 and 0.0 are one value
to PyTorch's math), True/False, "none", tuples as a,b(,c), strings as they are.
"""
import sys

import torch

STEPS = 2
SHAPES = [(3, 4), (5,), (2, 3)]
SHAPES_FOR = {"Muon": [(3, 4), (4, 2), (2, 3)]}  # Muon takes 2-D parameters only
SPARSE_GRADS = {"SparseAdam"}

# Options that bring every state entry into being (amsgrad's max_exp_avg_sq, RMSprop's
# momentum_buffer and grad_avg, SGD's momentum_buffer) and the plain defaults. The five twins'
# cases use only options LibTorch has, so that state_keys_test builds the same LibTorch optimizer.
CASES = {
    "SGD": [dict(lr=0.1), dict(lr=0.1, momentum=0.9)],
    "Adam": [dict(lr=0.01), dict(lr=0.01, amsgrad=True, weight_decay=0.1)],
    "AdamW": [dict(lr=0.01), dict(lr=0.01, amsgrad=True)],
    "Adagrad": [dict(lr=0.1), dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)],
    "RMSprop": [dict(lr=0.01), dict(lr=0.01, momentum=0.9, centered=True)],
    "Adadelta": [dict(lr=1.0)],
    "Adamax": [dict(lr=0.002)],
    "Rprop": [dict(lr=0.01)],
    "NAdam": [dict(lr=0.002), dict(lr=0.002, decoupled_weight_decay=True, weight_decay=0.1)],
    "RAdam": [dict(lr=0.001), dict(lr=0.001, decoupled_weight_decay=True, weight_decay=0.1)],
    "ASGD": [dict(lr=0.01)],
    "Adafactor": [dict(lr=0.01)],
    "SparseAdam": [dict(lr=0.001)],
    "Muon": [dict(lr=0.02), dict(lr=0.02, adjust_lr_fn="match_rms_adamw")],
}


def fmt(v):
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, (tuple, list)):
        return ",".join(fmt(x) for x in v)
    if isinstance(v, str):
        return v
    if isinstance(v, (int, float)):
        return repr(float(v))
    raise TypeError("no format for %r" % (v,))


def shape(s):
    return ",".join(str(d) for d in s) if len(s) > 0 else "scalar"


def write_case(out, name, options):
    shapes = SHAPES_FOR.get(name, SHAPES)
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64))
              for s in shapes]
    opt = getattr(torch.optim, name)(params, **options)
    for _ in range(STEPS):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name in SPARSE_GRADS:
                g = g.to_sparse(1)
            p.grad = None if i == len(params) - 1 else g
        opt.step()
    sd = opt.state_dict()
    assert len(sd["param_groups"]) == 1
    out.append("case " + name)
    out.append("options " + " ".join("%s=%s" % (k, fmt(v)) for k, v in options.items()))
    out.append("shapes " + " ".join(shape(s) for s in shapes))
    if name in SPARSE_GRADS:
        out.append("sparse_grads 1")
    out.append("steps %d" % STEPS)
    for key, value in sd["param_groups"][0].items():
        if key != "params":
            out.append("group %s %s" % (key, fmt(value)))
    for index in sorted(sd["state"]):
        for key, value in sd["state"][index].items():
            if torch.is_tensor(value):
                kind, dims = str(value.dtype).replace("torch.", ""), shape(tuple(value.shape))
            else:
                kind, dims = type(value).__name__, "-"
            out.append("state %d %s %s %s" % (index, key, kind, dims))
    out.append("end")


def main(path):
    out = ["dtrain-state-keys 1", "torch " + torch.__version__]
    for name, cases in CASES.items():
        if not hasattr(torch.optim, name):
            out.append("absent " + name)
            print("absent %s: PyTorch %s has no torch.optim.%s" % (name, torch.__version__, name),
                  file=sys.stderr)
            continue
        for options in cases:
            write_case(out, name, options)
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
