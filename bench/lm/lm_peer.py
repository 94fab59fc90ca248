#!/usr/bin/env python3
"""PyTorch twin of //bench/lm:lm_train: the same character language model (parameter names,
shapes, initial weights from the seed, forward pass op for op), the same text split, the same
batches (splitmix64, as in bench/lm/char_lm.cc) and the same CSV (step,train_loss,val_loss), with
torch.optim's optimizers -- or torchao's AdamW8bit/AdamW4bit/AdamWFp8 and its AdamW's
bf16_stochastic_round, when torchao is installed (otherwise those runs are skipped, saying so).

    ./bazelw --exec /usr/bin/python3 bench/lm/lm_peer.py --steps=300 --csv=/tmp/lm/py.csv \
        --init_in=/tmp/lm/init.pt          # the weights lm_train --init_out wrote
    ./bazelw --exec /usr/bin/python3 bench/lm/lm_peer.py --optimizer=AdamW8bit   # torchao
    ./bazelw --exec /usr/bin/python3 bench/lm/lm_peer.py --print_offsets=4      # the sampler

Flags and defaults are lm_train's; --options=key=value,... become the optimizer's keyword
arguments, parsed as lm_train parses them (true/false, none, ints, floats, a:b tuples, strings).
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

MASK64 = (1 << 64) - 1
TRAIN_STREAM, VAL_STREAM = 0, 1
VAL_DIVISOR, MIN_VAL_BYTES = 10, 2048
TORCHAO_OPTIMIZERS = ("AdamW8bit", "AdamW4bit", "AdamWFp8", "_AdamW")


def splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def sample_offset(seed, stream, step, index, count):
    h = splitmix64(seed & MASK64)
    h = splitmix64(h ^ stream)
    h = splitmix64(h ^ step)
    h = splitmix64(h ^ index)
    return h % count


def expand_text_paths(entries):
    files = set()
    for entry in entries:
        if not os.path.exists(entry):
            sys.exit("lm_peer: text file or directory %s not found" % entry)
        if not os.path.isdir(entry):
            files.add(entry)
            continue
        for dirpath, dirnames, filenames in os.walk(entry):
            for name in filenames:
                path = os.path.join(dirpath, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    files.add(path)
    if not files:
        sys.exit("lm_peer: no text files: give --text=FILE[,FILE or DIRECTORY...]")
    return sorted(files, key=lambda p: p.encode())


def load_text(entries):
    files = expand_text_paths(entries)
    data = b"".join(open(f, "rb").read() for f in files)
    if len(data) // VAL_DIVISOR < MIN_VAL_BYTES:
        sys.exit("lm_peer: the text files hold %d bytes; at least %d are needed" %
                 (len(data), MIN_VAL_BYTES * VAL_DIVISOR))
    n_val = len(data) // VAL_DIVISOR
    all_bytes = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return files, len(data), all_bytes[:len(data) - n_val], all_bytes[len(data) - n_val:]


def sample_batch(split, batch_size, context, seed, stream, step):
    n = split.numel()
    if n <= context:
        sys.exit("lm_peer: the split holds %d bytes, not more than context %d" % (n, context))
    starts = [sample_offset(seed, stream, step, b, n - context) for b in range(batch_size)]
    idx = torch.tensor(starts, dtype=torch.long).unsqueeze(1) + \
        torch.arange(context + 1, dtype=torch.long).unsqueeze(0)
    chunk = split[idx].to(torch.long)
    return chunk[:, :context], chunk[:, 1:context + 1]


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        hd = c // self.n_heads
        q, k, v = self.qkv(x).split(c, 2)
        q = q.view(b, t, self.n_heads, hd).transpose(1, 2)
        k = k.view(b, t, self.n_heads, hd).transpose(1, 2)
        v = v.view(b, t, self.n_heads, hd).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(float(hd)))
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = torch.softmax(att.masked_fill(future, float("-inf")), -1)
        y = torch.matmul(att, v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class Mlp(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, hidden):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = Mlp(d_model, hidden)

    def forward(self, x):
        h = x + self.attn(self.ln1(x))
        return h + self.mlp(self.ln2(h))


class CharLM(nn.Module):
    def __init__(self, vocab_size=256, d_model=192, n_layers=4, n_heads=4, context=128,
                 mlp_ratio=4, init_std=0.02, seed=0):
        super().__init__()
        if d_model % n_heads != 0:
            sys.exit("lm_peer: d_model (%d) must be a multiple of n_heads (%d)" % (d_model, n_heads))
        self.vocab_size, self.context, self.n_layers, self.init_std = \
            vocab_size, context, n_layers, init_std
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(
            [Block(d_model, n_heads, mlp_ratio * d_model) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed):
        gen = torch.Generator().manual_seed(seed)
        residual_std = self.init_std / math.sqrt(2.0 * self.n_layers)
        for name, p in self.named_parameters():
            module = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
            if name.endswith(".bias"):
                p.zero_()
            elif module.startswith("ln"):
                p.fill_(1.0)
            elif name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                p.normal_(0.0, residual_std, generator=gen)
            else:
                p.normal_(0.0, self.init_std, generator=gen)

    def forward(self, tokens):
        t = tokens.shape[1]
        pos = torch.arange(t, dtype=torch.long, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, inputs, targets):
        logits = self.forward(inputs)
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))


def parse_value(s):
    lower = s.lower()
    if lower in ("true", "false"):
        return lower == "true"
    if lower == "none":
        return None
    for kind in (int, float):
        try:
            return kind(s)
        except ValueError:
            pass
    if ":" in s:
        try:
            return tuple(float(part) for part in s.split(":"))
        except ValueError:
            pass
    return s


def parse_options(text):
    options = {}
    for item in text.split(",") if text else []:
        key, eq, value = item.partition("=")
        if not eq or not key:
            sys.exit("lm_peer: option '%s' must be key=value" % item)
        if key in options:
            sys.exit("lm_peer: option '%s' is given twice" % key)
        options[key] = parse_value(value)
    return options


def make_optimizer(args, params):
    kwargs = {"lr": args.lr}
    if args.weight_decay >= 0:
        kwargs["weight_decay"] = args.weight_decay
    for key, value in parse_options(args.options).items():
        if key in kwargs:
            sys.exit("lm_peer: option '%s' has its own flag (--%s)" % (key, key))
        kwargs[key] = value
    if args.optimizer in TORCHAO_OPTIMIZERS or "bf16_stochastic_round" in kwargs:
        try:
            import torchao.optim as ao  # noqa: PLC0415 (optional)
        except ImportError as e:
            print("lm_peer: SKIPPED: --optimizer=%s%s needs torchao, which is not installed (%s)" %
                  (args.optimizer, " with bf16_stochastic_round" if "bf16_stochastic_round" in
                   kwargs else "", e))
            sys.exit(0)
        name = "_AdamW" if args.optimizer == "AdamW" else args.optimizer
        return getattr(ao, name)(params, **kwargs)
    if not hasattr(torch.optim, args.optimizer):
        sys.exit("lm_peer: torch.optim has no optimizer %s" % args.optimizer)
    return getattr(torch.optim, args.optimizer)(params, **kwargs)


def validation_loss(model, val, args):
    total = 0.0
    with torch.no_grad():
        for i in range(args.eval_batches):
            x, y = sample_batch(val, args.batch_size, args.context, args.seed, VAL_STREAM, i)
            total += model.loss(x, y).item()
    return total / float(args.eval_batches)


def csv_row(step, train_loss, val_loss):
    return "%d,%.9g,%s" % (step, train_loss, "" if val_loss is None else "%.9g" % val_loss)


def train(model, opt, train_split, val, args, csv):
    model.train()
    losses, val_loss, seconds = [], None, 0.0
    for s in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x, y = sample_batch(train_split, args.batch_size, args.context, args.seed, TRAIN_STREAM, s)
        if args.warmup > 0:
            for group in opt.param_groups:
                lr = args.lr * min(1.0, float(s) / float(args.warmup))
                if isinstance(group["lr"], torch.Tensor):  # torchao keeps lr a tensor
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        seconds += time.perf_counter() - t0
        losses.append(loss.item())
        val_loss = None
        if s % args.eval_every == 0 or s == args.steps:
            val_loss = validation_loss(model, val, args)
            print("step %d/%d  train_loss %.4f  val_loss %.4f" %
                  (s, args.steps, losses[-1], val_loss), flush=True)
        if csv:
            csv.write(csv_row(s, losses[-1], val_loss) + "\n")
            if val_loss is not None:
                csv.flush()
    tail = losses[-min(10, args.steps):]
    return sum(tail) / len(tail), val_loss, args.steps / seconds if seconds > 0 else 0.0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", default="/usr/share/common-licenses")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", default="AdamW")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--options", default="")
    p.add_argument("--csv", default="")
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--eval_batches", type=int, default=4)
    p.add_argument("--init_out", default="")
    p.add_argument("--init_in", default="")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--d_model", type=int, default=192)
    p.add_argument("--n_layers", type=int, default=4)
    p.add_argument("--n_heads", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--print_offsets", type=int, default=0,
                   help="print sample_offset(seed, stream, step, b, count) for stream 0..1, step "
                        "0..2, b < N, count 1000003, and exit (the test compares them with C++)")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "eval_every", "eval_batches", "threads"):
        if getattr(args, name) < 1:
            p.error("--%s must be at least 1" % name)
    return args


def main(argv):
    args = parse_args(argv)
    if args.warmup < 0:
        sys.exit("lm_peer: --warmup must be at least 0")
    if args.print_offsets:
        for stream in (TRAIN_STREAM, VAL_STREAM):
            for step in range(3):
                print(" ".join(str(sample_offset(args.seed, stream, step, b, 1000003))
                               for b in range(args.print_offsets)))
        return 0
    torch.set_num_threads(args.threads)
    files, total, train_split, val = load_text([e for e in args.text.split(",") if e])
    model = CharLM(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                   context=args.context, seed=args.seed)
    if args.init_in:
        model.load_state_dict(torch.load(args.init_in, weights_only=True), strict=True)
    if args.init_out:
        torch.save(model.state_dict(), args.init_out)
    print("text: %d files, %d bytes (train %d, val %d); model: %d parameters; %s" %
          (len(files), total, train_split.numel(), val.numel(),
           sum(p.numel() for p in model.parameters()), args.optimizer))
    opt = make_optimizer(args, list(model.parameters()))  # before the CSV: a skip writes none
    csv = open(args.csv, "w") if args.csv else None
    if csv:
        csv.write("step,train_loss,val_loss\n")
    final_train, final_val, steps_per_s = train(model, opt, train_split, val, args, csv)
    if csv:
        csv.close()
    print("final train_loss %.4f val_loss %.4f steps/s %.3f" % (final_train, final_val, steps_per_s))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
