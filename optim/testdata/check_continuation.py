"""The other direction of optim/python_continuation_test.cc: PyTorch loads the optimizer state dicts
dtrain wrote after continuing each case, and must go on exactly as if PyTorch had trained alone.

  python3 optim/testdata/check_continuation.py DIR WHO

For every case in DIR/cases.txt: DIR/<case>.pt is make_continuation.py's file; DIR/<case>.<WHO>.pt
is what dtrain wrote ({"params": [...], "state_dict": ...} after the N continuation steps). Python
replays the N steps itself from <case>.pt, then takes one more step with the same gradient in its
own optimizer and in a fresh one loaded with dtrain's params and state dict: the parameters must
agree. Prints "<case> ok" lines, or "<case> FAIL <why>"; exit status 1 on any failure.
"""
import os
import sys

import torch


def build(cls_name, params_by_group, state_dict):
    groups = [dict(params=ps) for ps in params_by_group]
    opt = getattr(torch.optim, cls_name)(groups, lr=0.5)
    opt.load_state_dict(state_dict)
    return opt


def main():
    d, who = sys.argv[1], sys.argv[2]
    weights_only = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 0)
    failed = False
    for case in open(os.path.join(d, "cases.txt")).read().split():
        src = torch.load(os.path.join(d, case + ".pt"), weights_only=weights_only)
        mine = torch.load(os.path.join(d, case + "." + who + ".pt"), weights_only=weights_only)
        groups = [g["params"] for g in src["state_dict"]["param_groups"]]

        def fresh(values):
            ps = [torch.nn.Parameter(v.clone()) for v in values]
            return ps, [[ps[i] for i in g] for g in groups]

        ps, by_group = fresh(list(src["model"].values()))
        opt = build(src["optimizer"], by_group, src["state_dict"])
        for gs in src["grads"]:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        qs, q_groups = fresh(mine["params"])
        other = build(src["optimizer"], q_groups, mine["state_dict"])
        last = src["grads"][-1]
        for p, q, g in zip(ps, qs, last):
            p.grad = g.clone()
            q.grad = g.clone()
        opt.step()
        other.step()
        tol = 1e-12 if ps[0].dtype == torch.float64 else 1e-6
        bad = [i for i, (p, q) in enumerate(zip(ps, qs)) if not torch.allclose(p, q, rtol=tol, atol=tol)]
        if bad:
            failed = True
            print("%s FAIL params %s differ after one more step from dtrain's state" % (case, bad))
        else:
            print("%s ok" % case)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
