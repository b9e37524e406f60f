"""A/B of attention kernels: the attention benchmark's five cases timed in several copies of the
package, each copy in its own process, the copies alternating round by round (so that a drift
of the lent GPU's clocks or of its host falls on every copy alike). Each copy is a directory
holding ``pitgen/`` and ``templates/``, e.g. the committed tree and a working tree:

    git archive HEAD pitgen templates | tar -x -C /tmp/base     # on the machine with git
    cp -r pitgen templates /tmp/new
    python3 scripts/ab_attention.py /tmp/base /tmp/new [--rounds 2] [--repeats 30]

Each child runs in its copy's directory, which leads its import path, reads the copy's
templates (``ab.PREAMBLE``) and checks that it imported its own copy. Per case it prints the
whole call (index and forward) and the forward alone with the index given, in microseconds
(median of ``repeats`` after the benchmark's L2 flush), and the forward's error against float32
SDPA with the mask.
"""
from __future__ import annotations

import sys

import ab

CHILD = r'''
import json, sys
tree, repeats = sys.argv[1], int(sys.argv[2])   # run in tree: it leads the import path
import numpy as np, torch
import pitgen
from pitgen import render
from pitgen.bench.attention import BIGBIRD, masks
from pitgen.bench.timing import Timer
from pitgen.ops import attention as A
if not (pitgen.__file__.startswith(tree) and str(render.template_dir()).startswith(tree)):
    raise SystemExit(f"imported {pitgen.__file__} / {render.template_dir()}, not {tree}")
timer = Timer(repeats=repeats)
mask_set = masks(np.random.default_rng(0))
cases = [("blocks 128x128, 90% sparse", 64), (BIGBIRD, 64), ("Longformer w256 + 16 global", 64),
         (BIGBIRD, 128), ("micro 1x64, 90% sparse", 64)]
torch.manual_seed(0)
qkv = {d: [torch.randn(1, 12, 4096, d, device="cuda", dtype=torch.float16) for _ in range(3)]
       for d in (64, 128)}
rows = {}
for name, d in cases:
    q, k, v = qkv[d]
    m = torch.from_numpy(mask_set[name]).cuda()
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           attn_mask=m)
    out, live = A.sparse_attention(q, k, v, m), m.any(-1)
    err = float((out.float() - ref)[..., live, :].norm() / ref[..., live, :].norm())
    whole = timer(lambda: A.sparse_attention(q, k, v, m))
    idx = A.block_index(q, k, v, m)
    compute = timer(lambda: A.sparse_attention(q, k, v, m, index=idx))
    rows[f"{name.split(',')[0][:24]} D{d}"] = (round(whole * 1e3, 1), round(compute * 1e3, 1), err)
print("RESULT", json.dumps(rows))
'''


def show(case: str, row: list) -> str:
    whole, compute, err = row
    return f"{case:28s} whole {whole:7.1f} us  forward {compute:7.1f} us  err {err:.1e}"


if __name__ == "__main__":
    sys.exit(ab.main(CHILD, show, __doc__))
