"""Checks files written by dtrain's torch_file_writer with Python's own torch.load.

Used by checkpoint/torch_file_writer_test.cc; also by hand, e.g. with PyTorch 2.6:
  chroot /var/cache/dtrain/trixie /usr/bin/python3 check_written_file.py FILE...

For each FILE it prints a section:
  == FILE
  ENTRIES <zip entry names in order>
  ALIGN ok | ALIGN bad <name> <data offset>      (every entry's data at a multiple of 64)
  CRC ok | CRC bad <name>                         (zipfile.testzip)
  LOAD <mode> ok | FAIL <error> | MISMATCH | 1.13-binfloat
        modes: default (torch.load(f)), weights_only (torch.load(f, weights_only=True)),
        mmap (2.x: torch.load(f, mmap=True)); every mode must give the same dump as default.
        1.13-binfloat: PyTorch 1.13's weights-only unpickler has no BINFLOAT opcode, so it
        refuses any file with a float scalar, its own torch.save files included.
  RESAVE same | same-ops | differs at <byte>: <ours> vs <torch.save's>
        (the loaded value saved again with torch.save: its data.pkl is byte-identical, or
        identical op for op, arguments decoded, once torch.save's one-item dicts and lists,
        K V SETITEM and X APPEND, are spelled as the writer spells them for LibTorch's unpickler,
        MARK K V SETITEMS and MARK X APPENDS; ints then compare by value, whatever LONG1's length)
  DUMP
  <one line per value, depth first, dicts in insertion order>
The dump's format is mirrored by dump() in torch_file_writer_test.cc:
  <path> none | bool 0/1 | int <decimal> | float <16 hex digits, big-endian bits>
         | str <utf-8 hex> | tuple n=<n> [obj=<id>] | list n=<n> obj=<id> | dict n=<n> obj=<id>
         | tensor dtype=<name> shape=<a,b> stride=<a,b> offset=<k> grad=<0/1> snbytes=<bytes>
                  storage=<id|empty> obj=<id> data=<hex of the contiguous elements>
  Dict item i: its key at <path>/#i.key, its value at <path>/#i; list/tuple item i at <path>/i.
  Ids number distinct objects (storages) in order of first appearance, so equal ids = shared.
"""
import io
import pickletools
import struct
import sys
import traceback
import zipfile

import torch

VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
INT_VIEWS = {1: (torch.uint8, "B"), 2: (torch.int16, "h"), 4: (torch.int32, "i"), 8: (torch.int64, "q")}


def storage_of(t):
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


def element_hex(t):
    t = t.detach().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    view, fmt = INT_VIEWS[t.element_size()]
    values = t.view(view).reshape(-1).tolist()
    return struct.pack("<%d%s" % (len(values), fmt), *values).hex()


def exact(arg):
    return struct.pack(">d", arg).hex() if isinstance(arg, float) else arg  # NaN != NaN


def ops(data):
    return [(op.name, exact(arg)) for op, arg, _ in pickletools.genops(data)]


def single_items_marked(data):
    """The ops of `data` with K V SETITEM as MARK K V SETITEMS, X APPEND as MARK X APPENDS."""
    listed = list(pickletools.genops(data))
    starts, marks, insert_mark = [], [], set()  # starts: op index where each stack item began
    for i, (op, _, _) in enumerate(listed):
        if op.name == "MARK":
            marks.append((len(starts), i))
            continue
        if op.name in ("SETITEM", "APPEND"):
            insert_mark.add(starts[-2 if op.name == "SETITEM" else -1])
        before = op.stack_before
        if pickletools.markobject in before:
            depth, first = marks.pop()
            below = before.index(pickletools.markobject)
            popped = starts[depth - below:depth]
        else:
            depth, first = len(starts), i
            below = len(before)
            popped = starts[depth - below:]
        del starts[depth - below:]
        starts.extend([min(popped + [first])] * len(op.stack_after))
    out = []
    for i, (op, arg, _) in enumerate(listed):
        if i in insert_mark:
            out.append(("MARK", None))
        out.append((op.name + "S", None) if op.name in ("SETITEM", "APPEND") else (op.name, exact(arg)))
    return out


class Dumper:
    def __init__(self):
        self.lines = []
        self.objs = {}
        self.storages = {}

    def obj(self, v):
        return self.objs.setdefault(id(v), len(self.objs))

    def walk(self, path, v):
        out = lambda text: self.lines.append(path + " " + text)
        if v is None:
            out("none")
        elif isinstance(v, bool):
            out("bool %d" % v)
        elif isinstance(v, int):
            out("int %d" % v)
        elif isinstance(v, float):
            out("float " + struct.pack(">d", v).hex())
        elif isinstance(v, str):
            out("str " + v.encode("utf-8").hex())
        elif isinstance(v, torch.Tensor):
            s = storage_of(v)
            ptr = s.data_ptr()
            sid = "empty" if s.nbytes() == 0 else str(self.storages.setdefault(ptr, len(self.storages)))
            out("tensor dtype=%s shape=%s stride=%s offset=%d grad=%d snbytes=%d storage=%s obj=%d data=%s" % (
                str(v.dtype)[len("torch."):], ",".join(map(str, v.shape)), ",".join(map(str, v.stride())),
                v.storage_offset(), v.requires_grad, s.nbytes(), sid, self.obj(v), element_hex(v)))
        elif isinstance(v, tuple):
            out("tuple n=%d" % len(v) + (" obj=%d" % self.obj(v) if v else ""))
            for i, x in enumerate(v):
                self.walk("%s/%d" % (path, i), x)
        elif isinstance(v, list):
            out("list n=%d obj=%d" % (len(v), self.obj(v)))
            for i, x in enumerate(v):
                self.walk("%s/%d" % (path, i), x)
        elif isinstance(v, dict):
            out("dict n=%d obj=%d" % (len(v), self.obj(v)))
            for i, (k, x) in enumerate(v.items()):
                self.walk("%s/#%d.key" % (path, i), k)
                self.walk("%s/#%d" % (path, i), x)
        else:
            out("unexpected " + type(v).__name__)


def dump(v):
    d = Dumper()
    d.walk("", v)
    return d.lines


def check(path):
    print("== " + path)
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        print("ENTRIES " + " ".join(i.filename for i in infos))
        raw = open(path, "rb").read()
        bad = []
        for i in infos:
            name_len, extra_len = struct.unpack("<HH", raw[i.header_offset + 26:i.header_offset + 30])
            start = i.header_offset + 30 + name_len + extra_len
            if start % 64:
                bad.append("%s %d" % (i.filename, start))
        print("ALIGN " + ("ok" if not bad else "bad " + ", ".join(bad)))
        broken = z.testzip()
        print("CRC " + ("ok" if broken is None else "bad " + broken))
        pkl = [i.filename for i in infos if i.filename.endswith("/data.pkl")][0]
        ours = z.read(pkl)

    modes = [("default", {}), ("weights_only", {"weights_only": True})]
    if VERSION >= (2, 1):
        modes.append(("mmap", {"mmap": True}))
    loaded, reference = None, None
    for mode, kwargs in modes:
        try:
            value = torch.load(path, **kwargs)
        except Exception as e:  # noqa: BLE001 - report whatever torch.load raised
            message = " ".join(str(e).split())
            if mode == "weights_only" and VERSION < (2, 0) and "Unsupported operand 71" in message:
                print("LOAD %s 1.13-binfloat" % mode)
            else:
                print("LOAD %s FAIL %s: %s" % (mode, type(e).__name__, message[:2000]))
            continue
        lines = dump(value)
        if reference is None:
            reference, loaded = lines, value
            print("LOAD %s ok" % mode)
        else:
            print("LOAD %s %s" % (mode, "ok" if lines == reference else "MISMATCH"))
    if loaded is None:
        print("RESAVE skipped")
        print("DUMP")
        return
    buf = io.BytesIO()
    torch.save(loaded, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        theirs = z.read([n for n in z.namelist() if n.endswith("/data.pkl")][0])
    if ours == theirs:
        print("RESAVE same")
    elif ops(ours) == single_items_marked(theirs):
        print("RESAVE same-ops")
    else:
        at = next((k for k in range(min(len(ours), len(theirs))) if ours[k] != theirs[k]), min(len(ours), len(theirs)))
        print("RESAVE differs at %d: %s vs %s" % (at, ours[at:at + 24].hex(), theirs[at:at + 24].hex()))
    print("DUMP")
    for line in reference:
        print(line)


def main():
    print("torch %s" % torch.__version__)
    for path in sys.argv[1:]:
        try:
            check(path)
        except Exception:  # noqa: BLE001
            print("ERROR " + " | ".join(traceback.format_exc().splitlines()))
    print("== end")


if __name__ == "__main__":
    main()
