"""PyTorch's side of zero_dcp_test: torch.distributed.checkpoint both ways with dtrain's ZeRO.

  dcp_continue.py continue CKPT WORLD OUT     dcp.load of CKPT (a dtrain checkpoint) into a plain
        module + torch.optim.Adam at WORLD Gloo ranks (get_state_dict / set_state_dict), then
        steps 3..5; OUT: the parameters after each step (torch.save, rank 0)
  dcp_continue.py save CKPT WORLD OUT [flat]  steps 0..2 from the test's initial parameters,
        dcp.save to CKPT at WORLD Gloo ranks (flat: flatten_optimizer_state_dict=True), then steps
        3..5 as above into OUT
  dcp_continue.py fsdp2 CKPT WORLD OUT        an FSDP2 (fully_shard) Linear(5, 7), Linear(7, 3) on
        WORLD Gloo ranks: steps 0..2 (loss = model(x).sum(), x the same on every rank), dcp.save
        of get_state_dict's DTensor shards to CKPT, then steps 3..5 into OUT (full parameters);
        where this PyTorch's FSDP2 cannot run on CPU, OUT.unsupported says why instead
  dcp_continue.py optimizers WORLD SPEC.json  for each [ckpt, name, options, out] of SPEC: a
        "continue" with torch.optim.<name>(**options) over the 2-D SHAPES_2D; an optimizer this
        PyTorch lacks is skipped with a line "skipped <name>"
Shapes, initial values, gradients and Adam's options are the test's (zero_dcp_test.cc).
"""
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

SHAPES = [(4, 3), (5,), (2, 3, 2), (7,), ()]
SHAPES_2D = [(4, 3), (2, 5), (6, 2)]  # every optimizer's, Muon's included (2-D only)
LR = 0.01


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def initial(i, shape):
    return torch.cos(torch.arange(numel(shape), dtype=torch.float32) * 0.37 + i).view(shape)


def grad(i, shape, step):
    return torch.sin(torch.arange(numel(shape), dtype=torch.float32) * 0.1 + step + 0.3 * i).view(shape)


class Model(torch.nn.Module):
    def __init__(self, shapes=SHAPES):
        super().__init__()
        self.shapes = shapes
        for i, shape in enumerate(shapes):
            self.register_parameter(f"p{i}", torch.nn.Parameter(initial(i, shape)))


def run_steps(model, opt, steps, trace):
    for step in steps:
        for i, shape in enumerate(model.shapes):
            getattr(model, f"p{i}").grad = grad(i, shape, step)
        opt.step()
        trace.append([getattr(model, f"p{i}").detach().clone() for i in range(len(model.shapes))])


def optimizers_main(rank, spec):
    import json
    for ckpt, name, options, out in json.load(open(spec)):
        if not hasattr(torch.optim, name):
            if rank == 0:
                print("skipped", name)
            continue
        model = Model(SHAPES_2D)
        opt = getattr(torch.optim, name)(model.parameters(), **options)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        trace = []
        run_steps(model, opt, range(3, 6), trace)
        if rank == 0:
            torch.save(trace, out)


def fsdp2_input():
    return torch.cos(torch.arange(20, dtype=torch.float32)).view(4, 5)


def fsdp2_main(rank, world, ckpt, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    trace = []
    try:
        loss = model(fsdp2_input()).sum()
    except Exception as e:  # PyTorch 2.6: FSDP2's CPU path calls Stream.record_event
        if rank == 0:
            with open(out + ".unsupported", "w") as f:
                f.write("PyTorch %s: FSDP2 on CPU fails at its first forward: %s: %s" % (
                    torch.__version__, type(e).__name__, e))
        return
    for step in range(6):
        if step == 3:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        if step > 0:
            loss = model(fsdp2_input()).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= 3:
            trace.append([p.full_tensor().detach().clone() for p in model.parameters()])
    if rank == 0:
        torch.save(trace, out)


def rank_main(rank, world, store, mode, ckpt, out, flat):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    warnings.simplefilter("ignore")
    if mode == "optimizers":
        optimizers_main(rank, ckpt)
        dist.barrier()
        dist.destroy_process_group()
        return
    if mode == "fsdp2":
        fsdp2_main(rank, world, ckpt, out)
        dist.barrier()
        dist.destroy_process_group()
        return
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    if mode == "save":
        run_steps(model, opt, range(3), [])
        msd, osd = get_state_dict(model, opt, options=options)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    else:
        msd, osd = get_state_dict(model, opt, options=options)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
    trace = []
    run_steps(model, opt, range(3, 6), trace)
    if rank == 0:
        torch.save(trace, out)
    dist.barrier()
    dist.destroy_process_group()


def main():
    if sys.argv[1] == "optimizers":  # optimizers WORLD SPEC
        sys.argv = [sys.argv[0], "optimizers", sys.argv[3], sys.argv[2], ""]
    mode, ckpt, world, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    flat = len(sys.argv) > 5 and sys.argv[5] == "flat"
    store = tempfile.mktemp(prefix="dcp_continue_store_")
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(world, store, mode, ckpt, out, flat), nprocs=world, join=True)


if __name__ == "__main__":
    main()
