#!/usr/bin/python3
"""Writes the reference trajectories the optim/ parity tests compare against.

Regenerate the checked-in files (PyTorch 2.14 of the default Debian sid root is the oracle):
    ./bazelw --exec /usr/bin/python3 optim/functional/testdata/make_reference.py optim/functional/testdata
An optimizer the installed PyTorch lacks (Muon before 2.9) is skipped, with a line on stderr,
and its file left alone.

For each optimizer, cases covering every option that changes the math, three parameters of
different shapes (2-D ones for Muon), 50 steps, and gradients missing on some steps (parameter 1
every 7th step, parameter 2 for the first 5: lazy state initialisation). Each case runs twice from
the same inputs: in float64 (to see rounding) and float32 (what the C++ fp32 run must match).
SparseAdam's gradients have rows of zeros (parameter 1's are all zero every 5th step) and reach
the optimizer as g.to_sparse(1), which drops those rows.

File format (text header + raw doubles, readable without an unpickler):
    dtrain-optim-reference 1
    optimizer NAME
    case NAME
    options key=value ...        (floats, ints, True/False, strings, tuples as a,b(,c); "none"
                                  for None, also inside a tuple)
    shapes 3,4 5 2,1,3
    sparse_grads 1               (only where the gradients are given as g.to_sparse(1))
    steps 50
    missing PARAM:STEP ...
    state PARAM KEY NUMEL KIND   (one line per state entry after the last step, float64 run;
                                  NUMEL "none" for a None value, which has no data; KIND the
                                  value's type in PyTorch's state: a tensor's dtype (float32,
                                  float64) or a Python type (int))
    end
    ... more cases ...
    data
then, little-endian float64, per case in order: the initial parameters (concatenated), per step
the gradients (zeros where missing), the float64 parameters and the float32 parameters after the
step, and finally the float64 run's state values in `state` line order.
"""
import inspect
import sys

import torch

SHAPES = [(3, 4), (5,), (2, 1, 3)]
SHAPES_FOR = {"Muon": [(3, 4), (5, 2), (4, 4)]}  # Muon takes 2-D parameters only
SPARSE_GRADS = {"SparseAdam"}  # gradients passed as g.to_sparse(1)
STEPS = 50


def missing(param, step):
    return (param == 1 and step % 7 == 3) or (param == 2 and step < 5)


class QHM(torch.optim.Optimizer):
    """Quasi-hyperbolic momentum (Ma & Yarats), as the seed recipe's qhm_update, with the momentum
    buffer kept across steps (the recipe's sample re-creates it each step, a bug)."""

    def __init__(self, params, lr, momentum, nu, weight_decay=0.0, weight_decay_type="grad"):
        super().__init__(params, dict(lr=lr, momentum=momentum, nu=nu, weight_decay=weight_decay,
                                      weight_decay_type=weight_decay_type))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad
                if g["weight_decay"] != 0:
                    if g["weight_decay_type"] == "grad":
                        d_p = d_p.add(p, alpha=g["weight_decay"])
                    else:
                        p.mul_(1.0 - g["lr"] * g["weight_decay"])
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(g["momentum"]).add_(d_p, alpha=1.0 - g["momentum"])
                p.add_(buf, alpha=-g["lr"] * g["nu"])
                p.add_(d_p, alpha=-g["lr"] * (1.0 - g["nu"]))


CASES = {
    "SGD": [
        dict(lr=0.1),
        dict(lr=0.05, momentum=0.9),
        dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
        dict(lr=0.05, momentum=0.9, nesterov=True),
        dict(lr=0.05, momentum=0.5, weight_decay=0.1, maximize=True),
    ],
    "Adam": [
        dict(lr=0.01),
        dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
        dict(lr=0.01, amsgrad=True),
        dict(lr=0.01, amsgrad=True, weight_decay=0.05, maximize=True),
    ],
    "AdamW": [
        dict(lr=0.01),
        dict(lr=0.01, weight_decay=0.2, amsgrad=True),
        dict(lr=0.01, betas=(0.85, 0.99), maximize=True),
    ],
    "Adagrad": [
        dict(lr=0.1),
        dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-5, weight_decay=0.05),
        dict(lr=0.1, maximize=True),
    ],
    "Adadelta": [
        dict(),
        dict(lr=0.5, rho=0.8, eps=1e-4, weight_decay=0.1),
        dict(lr=0.5, maximize=True),
    ],
    "Adamax": [
        dict(lr=0.01),
        dict(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1),
        dict(lr=0.01, maximize=True),
    ],
    "RMSprop": [
        dict(lr=0.01),
        dict(lr=0.01, centered=True),
        dict(lr=0.01, momentum=0.9),
        dict(lr=0.01, alpha=0.9, centered=True, momentum=0.5, weight_decay=0.1, maximize=True),
    ],
    "Rprop": [
        dict(lr=0.01),
        dict(lr=0.02, etas=(0.3, 1.5), step_sizes=(1e-3, 0.1)),
        dict(lr=0.01, maximize=True),
    ],
    "NAdam": [
        dict(lr=0.01),
        dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, momentum_decay=0.01),
        dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
        dict(lr=0.01, momentum_decay=0.0, maximize=True),
    ],
    "RAdam": [
        dict(lr=0.01),
        dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
        dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
        dict(lr=0.01, betas=(0.5, 0.9), maximize=True),
    ],
    "ASGD": [
        dict(lr=0.01),
        dict(lr=0.05, lambd=0.01, alpha=0.5, t0=10.0, weight_decay=0.1),
        dict(lr=0.02, t0=0.0, maximize=True),
    ],
    "Adafactor": [
        dict(lr=0.01),
        dict(lr=0.05, beta2_decay=-0.5, eps=(1e-4, 1e-2), d=2.0, weight_decay=0.1),
        dict(lr=0.5, eps=(None, 1e-3), d=1.0, maximize=True),
    ],
    "SparseAdam": [
        dict(lr=0.01),
        dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, maximize=True),
    ],
    "Muon": [
        dict(lr=0.02),
        dict(lr=0.02, weight_decay=0.0, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw"),
        dict(lr=0.02, ns_coefficients=(3.0, -3.2, 1.2), eps=1e-5, ns_steps=3, adjust_lr_fn="spectral_unclamped"),
        dict(lr=0.02, momentum=0.0, adjust_lr_fn="original"),
    ],
    "QHM": [
        dict(lr=0.1, momentum=0.9, nu=0.7),
        dict(lr=0.1, momentum=0.9, nu=0.7, weight_decay=0.1, weight_decay_type="grad"),
        dict(lr=0.1, momentum=0.8, nu=1.0, weight_decay=0.1, weight_decay_type="direct"),
    ],
}


def make(name, options, params):
    if name == "QHM":
        return QHM(params, **options)
    cls = getattr(torch.optim, name)
    kwargs = dict(options)
    if "foreach" in inspect.signature(cls).parameters:
        kwargs["foreach"] = False  # the single-tensor implementation is the spec
    return cls(params, **kwargs)


def available(name):
    return name == "QHM" or hasattr(torch.optim, name)


def fmt(v):
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, tuple):
        return ",".join(fmt(float(x) if isinstance(x, int) else x) for x in v)
    if isinstance(v, str):
        return v
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def sparse_mask(gen, shape, param, step):
    """SparseAdam's gradients: zero rows (all of parameter 1 every 5th step: an empty gradient)."""
    keep = (torch.rand(shape[0], generator=gen, dtype=torch.float64) < 0.6).double()
    if param == 1 and step % 5 == 2:
        keep.zero_()
    return keep.reshape((shape[0],) + (1,) * (len(shape) - 1))


def run(name, options, init, grads, dtype):
    params = [torch.nn.Parameter(t.clone().to(dtype)) for t in init]
    opt = make(name, options, params)
    traj = []
    for step in range(STEPS):
        for i, p in enumerate(params):
            g = None if missing(i, step) else grads[step][i].to(dtype).clone()
            if g is not None and name in SPARSE_GRADS:
                g = g.to_sparse(1)
            p.grad = g
        opt.step()
        traj.append([p.detach().clone().double() for p in params])
    return traj, opt, params


def write(name, out_dir):
    header = ["dtrain-optim-reference 1", "optimizer " + name]
    blob = []
    shapes = SHAPES_FOR.get(name, SHAPES)
    for ci, options in enumerate(CASES[name]):
        gen = torch.Generator().manual_seed(1000 + ci)
        init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        # fp32-representable inputs, so both runs start from identical numbers.
        init = [t.float().double() for t in init]
        grads = [[torch.randn(s, generator=gen, dtype=torch.float64).float().double() for s in shapes]
                 for _ in range(STEPS)]
        if name in SPARSE_GRADS:
            grads = [[g * sparse_mask(gen, g.shape, i, step) for i, g in enumerate(row)]
                     for step, row in enumerate(grads)]
        t64, opt64, params64 = run(name, options, init, grads, torch.float64)
        t32, _, _ = run(name, options, init, grads, torch.float32)
        header.append("case %s_%d" % (name, ci))
        header.append("options " + " ".join("%s=%s" % (k, fmt(v)) for k, v in options.items()))
        header.append("shapes " + " ".join(",".join(str(d) for d in s) for s in shapes))
        if name in SPARSE_GRADS:
            header.append("sparse_grads 1")
        header.append("steps %d" % STEPS)
        header.append("missing " + " ".join("%d:%d" % (i, s) for s in range(STEPS)
                                            for i in range(len(shapes)) if missing(i, s)))
        state_values = []
        for i, p in enumerate(params64):
            for key in sorted(opt64.state[p].keys()):
                v = opt64.state[p][key]
                if v is None:  # SGD without momentum keeps momentum_buffer=None
                    header.append("state %d %s none" % (i, key))
                    continue
                t = v.detach().double().reshape(-1) if torch.is_tensor(v) else torch.tensor([float(v)], dtype=torch.float64)
                kind = str(v.dtype).replace("torch.", "") if torch.is_tensor(v) else type(v).__name__
                header.append("state %d %s %d %s" % (i, key, t.numel(), kind))
                state_values.append(t)
        header.append("end")
        for t in init:
            blob.append(t.reshape(-1))
        for s in range(STEPS):
            for i in range(len(shapes)):
                blob.append(torch.zeros(shapes[i], dtype=torch.float64).reshape(-1) if missing(i, s)
                            else grads[s][i].reshape(-1))
            blob.extend(t.reshape(-1) for t in t64[s])
            blob.extend(t.reshape(-1) for t in t32[s])
        blob.extend(state_values)
    header.append("data")
    data = torch.cat(blob).numpy().astype("<f8").tobytes()
    with open("%s/%s.ref" % (out_dir, name.lower()), "wb") as f:
        f.write(("\n".join(header) + "\n").encode())
        f.write(data)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    for name in CASES:
        if not available(name):
            print("skipped %s: PyTorch %s has no torch.optim.%s (no %s/%s.ref written)"
                  % (name, torch.__version__, name, out, name.lower()), file=sys.stderr)
            continue
        write(name, out)
        print("wrote %s/%s.ref" % (out, name.lower()))
