"""DCP checkpoints written by PyTorch, and PyTorch's view of a .metadata, for dcp_metadata_test.

  make_dcp_files.py write DIR   writes DIR/plain (a model + Adam through get_state_dict, one
                                process) and DIR/sharded (two Gloo ranks, a DTensor row-sharded
                                across them, so keys have two chunks), each with summary.txt
  make_dcp_files.py read DIR    prints the summary of DIR/.metadata as PyTorch reads it
  make_dcp_files.py load DIR    dcp.load of dcp_test's checkpoint into a plain state dict; prints it

The summary has one line per key, sorted: "tensor KEY DTYPE SIZE [OFFSETS SIZES FILE OFFSET
LENGTH]..." or "bytes KEY FILE OFFSET LENGTH"; the C++ test prints the same for its reading.
"""
import os
import pickle
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata


def dims(size):
    return "x".join(str(d) for d in size) or "scalar"


def summary(path):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    lines = []
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            info = md.storage_data[next(i for i in md.storage_data if i.fqn == key)]
            lines.append(f"bytes {key} {info.relative_path} {info.offset} {info.length}")
            continue
        parts = [f"tensor {key} {str(item.properties.dtype)} {dims(item.size)}"]
        for chunk in sorted(item.chunks, key=lambda c: tuple(c.offsets)):
            info = next(v for k, v in md.storage_data.items()
                        if k.fqn == key and tuple(k.offset) == tuple(chunk.offsets))
            parts.append(f"[{dims(chunk.offsets)} {dims(chunk.sizes)} {info.relative_path} "
                         f"{info.offset} {info.length}]")
        lines.append(" ".join(parts))
    return sorted(lines)


def plain(out):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    o = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randn(5, 3)).sum().backward()
    o.step()
    msd, osd = get_state_dict(m, o)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)


def sharded_rank(rank, world, store_file, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(30, dtype=torch.float64).reshape(5, 6)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]),
             "b": torch.arange(4, dtype=torch.float32), "step": 7}
    dcp.save(state, checkpoint_id=out)
    dist.destroy_process_group()


def sharded(out):
    import torch.multiprocessing as mp
    store = tempfile.mktemp(prefix="dcp_store_")
    mp.spawn(sharded_rank, args=(2, store, out), nprocs=2, join=True)


def main():
    if sys.argv[1] == "write":
        # Each checkpoint from its own Python process group. PyTorch 2.6's two spawned Gloo ranks
        # sometimes hang under load (seen 3 times in ~10 loaded runs, never on 2.14/2.15): a
        # writer that has not finished in 75 s is killed with all its processes (so none keeps
        # the test's pipe open) and run again, at most three times, each retry said on stderr.
        import signal
        import subprocess
        for name in ("plain", "sharded"):
            for attempt in range(3):
                p = subprocess.Popen([sys.executable, __file__, "write-one", name, sys.argv[2]],
                                     start_new_session=True)
                try:
                    if p.wait(timeout=75) != 0:
                        sys.exit("writing the %s checkpoint failed" % name)
                    break
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    print("make_dcp_files: the %s writer hung; killed, attempt %d of 3" % (
                        name, attempt + 2), file=sys.stderr)
            else:
                sys.exit("the %s writer hung three times" % name)
    elif sys.argv[1] == "write-one":
        name, root = sys.argv[2], sys.argv[3]
        out = os.path.join(root, name)
        os.makedirs(out, exist_ok=True)
        {"plain": plain, "sharded": sharded}[name](out)
        with open(os.path.join(out, "summary.txt"), "w") as f:
            f.write("\n".join(summary(out)) + "\n")
    elif sys.argv[1] == "load":
        load_mine(sys.argv[2])
    else:
        print("\n".join(summary(sys.argv[2])))


def load_mine(path):
    """Loads a dtrain-written checkpoint with dcp.load (one process) and prints its values."""
    import warnings
    state = {"w": torch.zeros(5, 6, dtype=torch.float64), "b": torch.zeros(4),
             "scalar": torch.zeros(()), "step": 0, "group": {"lr": 0.0, "betas": (0.0, 0.0)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path)
    print("w", state["w"].flatten().tolist())
    print("b", state["b"].tolist())
    print("scalar", state["scalar"].item())
    print("step", state["step"])
    print("group", state["group"]["lr"], tuple(state["group"]["betas"]))
    # PyTorch's converter rebuilds the nested dict from the metadata's planner_data.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = os.path.join(tempfile.mkdtemp(), "converted.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(path, out)
    converted = torch.load(out, weights_only=True)
    print("dcp_to_torch_save", sorted(converted), converted["group"]["lr"],
          converted["w"].flatten().tolist() == state["w"].flatten().tolist())


if __name__ == "__main__":
    main()
