"""Writes the PyTorch files checkpoint/state_file_test.cc reads, and digests of what they hold.

Run at test time by the C++ tests (nothing generated is checked in), with /usr/bin/python3 (Debian's
PyTorch 1.13) or $DTRAIN_PYTHON; by hand, to look at the files or to produce them with another
PyTorch (e.g. 2.6, for DTRAIN_PYTHON_FILES_DIR):

  python3 checkpoint/testdata/make_python_files.py write OUT_DIR
      writes OUT_DIR/<name>.pt and OUT_DIR/<name>.txt (the digest of the value saved) for every name
      in NAMES, plus legacy.pt (pre-1.6 format), object.pt (a pickled class instance) and
      os_system.pt (a pickle that would run os.system when Python unpickles it without
      weights_only; it writes OUT_DIR/os_system_ran if it ever runs).
  python3 checkpoint/testdata/make_python_files.py digest FILE
      prints the digest of torch.load(FILE) (weights_only=True on PyTorch 2.x).

Digest: one line per value, depth first in iteration order:
  <path> dict|list|tuple <len>       then the children, path + '/' + key ('s:name', 'i:3',
                                      'f:<16 hex digits of the double>', 'b:True') or index
  <path> tensor <dtype> [<sizes>] [<strides>] <offset> <requires_grad> <storage> <hex of the bytes>
                                      storage: s<k>, k-th distinct storage in this order; s- if empty
  <path> int <n> | float <16 hex digits, big-endian IEEE 754> | bool True|False | None | str <hex of UTF-8>
"""
import collections
import os
import struct
import sys
import zipfile

import torch

NAMES = [
    "adam_one", "adam_many", "adam_two_groups", "adam_amsgrad", "sgd_momentum", "rmsprop_centered",
    "adagrad", "adamw", "scheduler", "nested", "float64", "protocol4", "protocol5", "views", "dtypes",
]


def key_text(k):
    if isinstance(k, bool):
        return "b:%s" % k
    if isinstance(k, int):
        return "i:%d" % k
    if isinstance(k, float):
        return "f:" + struct.pack(">d", k).hex()
    return "s:" + str(k)


def storage_ptr(t):
    s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    return s.data_ptr()


def tensor_bytes(t):
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def walk(path, v, storages, out):
    if isinstance(v, dict):
        out.append("%s dict %d" % (path, len(v)))
        for k, x in v.items():
            walk(path + "/" + key_text(k), x, storages, out)
    elif isinstance(v, (list, tuple)):
        out.append("%s %s %d" % (path, "list" if isinstance(v, list) else "tuple", len(v)))
        for i, x in enumerate(v):
            walk("%s/%d" % (path, i), x, storages, out)
    elif torch.is_tensor(v):
        storage = "s-"
        if v.numel():
            storage = "s%d" % storages.setdefault(storage_ptr(v), len(storages))
        out.append("%s tensor %s [%s] [%s] %d %s %s %s" % (
            path, v.dtype, ", ".join(str(s) for s in v.shape), ", ".join(str(s) for s in v.stride()),
            v.storage_offset(), v.requires_grad, storage, tensor_bytes(v).hex()))
    elif isinstance(v, bool):
        out.append("%s bool %s" % (path, v))
    elif isinstance(v, int):
        out.append("%s int %d" % (path, v))
    elif isinstance(v, float):
        out.append("%s float %s" % (path, struct.pack(">d", v).hex()))
    elif v is None:
        out.append("%s None" % path)
    elif isinstance(v, str):
        out.append("%s str %s" % (path, v.encode("utf-8").hex()))
    else:
        raise TypeError("%s: %r" % (path, type(v)))


def digest(v):
    out = []
    walk("", v, {}, out)
    return "\n".join(out) + "\n"


def stepped(opt_class, params, groups=None, steps=2, **kw):
    opt = opt_class(groups if groups is not None else params, **kw)
    for i in range(steps):
        opt.zero_grad()
        loss = sum(((p * (j + 1.5)) ** 2).sum() for j, p in enumerate(params))
        loss.backward()
        opt.step()
    return opt


def params(shapes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]


def model_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).sum().backward()
        opt.step()
    return model, opt


def values():
    """name -> (value, pickle_protocol)"""
    torch.manual_seed(0)
    out = {}
    out["adam_one"] = stepped(torch.optim.Adam, params([(3,)]), steps=1).state_dict()
    out["adam_many"] = stepped(torch.optim.Adam, params([(3,), (2, 4), (1,), (5, 1, 2), ()])).state_dict()
    p = params([(2,), (3,), (4,)])
    out["adam_two_groups"] = stepped(torch.optim.Adam, p, groups=[
        {"params": p[:2]}, {"params": p[2:], "lr": 0.5, "betas": (0.8, 0.9)}]).state_dict()
    out["adam_amsgrad"] = stepped(torch.optim.Adam, params([(3,), (2, 2)]), amsgrad=True).state_dict()
    out["sgd_momentum"] = stepped(torch.optim.SGD, params([(3,), (2, 2)]), lr=0.1, momentum=0.9).state_dict()
    out["rmsprop_centered"] = stepped(torch.optim.RMSprop, params([(3,), (2, 2)]), centered=True,
                                      momentum=0.5).state_dict()
    out["adagrad"] = stepped(torch.optim.Adagrad, params([(3,), (2, 2)])).state_dict()
    out["adamw"] = stepped(torch.optim.AdamW, params([(3,), (2, 2)]), weight_decay=0.1).state_dict()
    opt = stepped(torch.optim.SGD, params([(3,)]), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()
    out["scheduler"] = opt.state_dict()
    model, opt = model_and_optimizer()
    nested = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7,
              "param": torch.nn.Parameter(torch.ones(2)), "note": "d\u00e9j\u00e0 vu", "none": None,
              "neg": -(2 ** 62), "nan": float("nan"), "ratio": -0.0}
    out["nested"] = nested
    out["float64"] = stepped(torch.optim.Adam, params([(3,), (2, 2)], torch.float64)).state_dict()
    out["protocol4"] = (nested, 4)
    out["protocol5"] = (nested, 5)
    base = torch.arange(24, dtype=torch.float32)
    out["views"] = {"base": base, "slice": base[2:8], "t": base.view(4, 6).t(), "strided": base[1::5],
                    "other": torch.arange(3)}
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
              torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
    out["dtypes"] = {str(d): (torch.arange(-3, 3) * 1.5).to(d) for d in dtypes}
    out["dtypes"]["empty"] = torch.zeros(0, 3)
    out["dtypes"]["scalar"] = torch.tensor(2.5)
    return out


class Thing:
    def __init__(self):
        self.x = 1


class RunsSystem:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


def write(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for name, v in values().items():
        protocol = 2
        if isinstance(v, tuple):
            v, protocol = v
        path = os.path.join(out_dir, name + ".pt")
        torch.save(v, path, pickle_protocol=protocol)
        with open(os.path.join(out_dir, name + ".txt"), "w") as f:
            f.write(digest(v))
    torch.save({"w": torch.ones(2)}, os.path.join(out_dir, "legacy.pt"), _use_new_zipfile_serialization=False)
    torch.save({"thing": Thing()}, os.path.join(out_dir, "object.pt"))
    marker = os.path.join(out_dir, "os_system_ran")
    torch.save({"w": torch.ones(2), "boom": RunsSystem(marker)}, os.path.join(out_dir, "os_system.pt"))
    # Sanity: the files really are zip archives of stored entries, as the reader expects.
    with zipfile.ZipFile(os.path.join(out_dir, "nested.pt")) as z:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "digest":
        major = int(torch.__version__.split(".")[0])
        v = torch.load(sys.argv[2], weights_only=True) if major >= 2 else torch.load(sys.argv[2])
        sys.stdout.write(digest(v))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
