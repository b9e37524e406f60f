"""A/B of the sparse matmul kernels: the fine-grained cells of ``pitgen bench matmul`` timed in
several copies of the package, each copy in its own process, the copies alternating round by
round (so that a drift of the lent GPU's clocks or of its host falls on every copy alike). Each
copy is a directory holding ``pitgen/`` and ``templates/``, e.g. the committed tree and a
working tree:

    git archive HEAD pitgen templates | tar -x -C /tmp/base     # on the machine with git
    cp -r pitgen templates /tmp/new
    python3 scripts/ab_matmul.py /tmp/base /tmp/new [--rounds 2] [--repeats 30]

Each child runs in its copy's directory, which leads its import path, reads the copy's
templates (``ab.PREAMBLE``) and checks that it imported its own copy. The
cells (4096³ fp16, masks at exactly their density, the benchmark's L2 flush before each run):
32×1 micro-tiles along k at 50, 90 and 99% sparsity, 16/64/128×1 at 90%, 1×64 rows at 90 and
99%, 128×128 blocks at 90%, each with its own micro-tile as the explicit plan. Per cell: the
index pass alone, the whole call (median of ``repeats``) and the relative error against fp32
``torch.matmul`` of the masked operands.
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
from pitgen.bench.workloads import block_mask
if not (pitgen.__file__.startswith(tree) and str(render.template_dir()).startswith(tree)):
    raise SystemExit(f"imported {pitgen.__file__} / {render.template_dir()}, not {tree}")
n = 4096
timer = Timer(repeats=repeats)
gen = torch.Generator(device="cuda").manual_seed(0)
b = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=gen)
a0 = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=gen)
out = torch.empty(n, n, device="cuda", dtype=torch.float16)
rows = {}
for unit, sparsities in (("32x1", (50, 90, 99)), ("16x1", (90,)), ("64x1", (90,)),
                         ("128x1", (90,)), ("1x64", (90, 99)), ("128x128", (90,))):
    shape = tuple(int(v) for v in unit.split("x"))
    for sp in sparsities:
        kern = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype="float16",
                              micro_tile=unit)
        a = a0 * block_mask((n, n), shape, 1 - sp / 100, gen).to(a0.dtype)
        ref = a.float() @ b.float()
        call = kern.prepare(a, b, out=out)
        index = timer(lambda: call.build_index(None))
        whole = timer(lambda: kern(a, b, out=out))
        err = float((out.float() - ref).norm() / ref.norm())
        rows[f"{unit} {sp}%"] = {"index": index * 1e3, "whole": whole * 1e3, "err": err}
print("RESULT", json.dumps(rows))
'''


def show(case: str, row: dict) -> str:
    return f"{case:14s} index {row['index']:6.1f} us  whole {row['whole']:7.1f} us  err {row['err']:.1e}"


if __name__ == "__main__":
    sys.exit(ab.main(CHILD, show, __doc__))
