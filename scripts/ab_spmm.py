"""A/B of the SpMM kernels on hyb with one column part (``c=1``: the split-row form, whose cut
rows run as pieces storing partial rows that the last piece sums), with the driver of
scripts/ab.py (copies of ``pitgen/`` and ``templates/`` given as directories, each timed in its
own process, alternating round by round):

    python3 scripts/ab_spmm.py /tmp/base /tmp/new [--rounds 2] [--repeats 30]

The case: ogbn-proteins' synthetic stand-in at a quarter of its size (9.9 M edges, every row
cut), fp16 and fp32, F 64 and 128; per case the call in microseconds (median of ``repeats``
after the benchmark's L2 flush) and the relative error against torch's CSR product in float32.
"""
from __future__ import annotations

import sys

import ab

CHILD = r'''
import json, sys
tree, repeats = sys.argv[1], int(sys.argv[2])   # run in tree: it leads the import path
import torch
import pitgen
from pitgen import render
from pitgen.bench.timing import Timer
from pitgen.graph import kernels as G
from pitgen.graph.device import DeviceCSR, to_format
from pitgen.graphs import make_graph
if not (pitgen.__file__.startswith(tree) and str(render.template_dir()).startswith(tree)):
    raise SystemExit(f"imported {pitgen.__file__} / {render.template_dir()}, not {tree}")
timer = Timer(repeats=repeats)
csr = make_graph("ogbn-proteins", seed=0, scale=0.25)
ip = torch.from_numpy(csr.indptr.astype("int32")).cuda()
ix = torch.from_numpy(csr.indices.astype("int32")).cuda()
g = torch.Generator(device="cuda").manual_seed(0)
rows = {}
for dt in ("float16", "float32"):
    vals = (torch.rand(csr.nnz, device="cuda", generator=g) + 0.5).to(getattr(torch, dt))
    m = to_format(DeviceCSR(csr.shape, ip, ix, vals), "hyb", c=1, k=6)
    ref_a = torch.sparse_csr_tensor(ip.long(), ix.long(), vals.float(), size=csr.shape)
    for feat in (64, 128):
        x = torch.randn(csr.shape[1], feat, device="cuda", generator=g).to(vals.dtype)
        y = torch.full((csr.shape[0], feat), float("nan"), dtype=x.dtype, device="cuda")
        G.spmm(m, x, out=y)
        ref = ref_a @ x.float()
        err = float((y.float() - ref).norm() / ref.norm())
        rows[f"{dt} F{feat}"] = (round(timer(lambda: G.spmm(m, x, out=y)) * 1e3, 2), err)
print("RESULT", json.dumps(rows))
'''


def show(case: str, row: list) -> str:
    ms, err = row
    return f"{case:14s} {ms:9.2f} us  err {err:.1e}"


if __name__ == "__main__":
    sys.exit(ab.main(CHILD, show, __doc__))
