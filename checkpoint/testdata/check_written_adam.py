"""Python's torch.optim.Adam loads the Adam state dict torch_file_writer_test.cc writes, and steps.

Usage: python3 check_written_adam.py FILE   (prints "adam ok")
"""
import sys

import torch

params = [torch.nn.Parameter(torch.zeros(i + 1, 6)) for i in range(3)]
opt = torch.optim.Adam(params)
opt.load_state_dict(torch.load(sys.argv[1]))
for p in params:
    p.grad = torch.ones_like(p)
opt.step()
assert int(opt.state[params[2]]["step"]) == 4, opt.state[params[2]]["step"]
print("adam ok")
