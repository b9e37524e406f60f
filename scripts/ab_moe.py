"""A/B of the MoE kernels: the layer under six routings timed in several copies of the package,
each copy in its own process, the copies alternating round by round (so that a drift of the
lent GPU's clocks or of its host falls on every copy alike). Each copy is a directory holding
``pitgen/`` and ``templates/``, e.g. the committed tree and a working tree:

    git archive HEAD pitgen templates | tar -x -C /tmp/base     # on the machine with git
    cp -r pitgen templates /tmp/new
    python3 scripts/ab_moe.py /tmp/base /tmp/new [--rounds 2] [--repeats 30]

Each child runs in its copy's directory, which leads its import path, reads the copy's
templates (``ab.PREAMBLE``) and checks that it imported its own copy. The
routings (T 4096, H 768, F 3072, fp16, GELU, biases) separate the costs: the benchmark's Zipf
routing at E 64 and 128 and top-2; 64 tokens an expert; 8 tokens an expert (512 tokens: every
weight streamed, almost no tensor work); every token to one expert (a dense GEMM pair). Per
routing it prints the whole call (median of ``repeats`` after the benchmark's L2 flush), each
kernel's time (torch.profiler, median of 15 calls after the flush) and the relative error
against a float64 loop over the experts.
"""
from __future__ import annotations

import sys

import ab

CHILD = r'''
import json, statistics, sys
tree, repeats = sys.argv[1], int(sys.argv[2])   # run in tree: it leads the import path
import numpy as np, torch
from torch.profiler import ProfilerActivity, profile
import pitgen
from pitgen import render
from pitgen.bench.moe import loop_peer, routing
from pitgen.bench.timing import Timer
from pitgen.ops.moe import moe_ffn
if not (pitgen.__file__.startswith(tree) and str(render.template_dir()).startswith(tree)):
    raise SystemExit(f"imported {pitgen.__file__} / {render.template_dir()}, not {tree}")
H, F, T = 768, 3072, 4096
timer = Timer(repeats=repeats)
flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
weights = {}

def case(E, ids):
    if E not in weights:
        g = torch.Generator(device="cuda").manual_seed(E)
        weights[E] = [torch.randn(*s, device="cuda", dtype=torch.float16, generator=g) * a
                      for s, a in (((E, H, F), 0.03), ((E, F, H), 0.03), ((E, F), 0.1), ((E, H), 0.1))]
    w1, w2, b1, b2 = weights[E]
    ids = torch.as_tensor(ids, device="cuda", dtype=torch.int32)
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(ids.shape[0], H, device="cuda", dtype=torch.float16, generator=g)
    gates = torch.rand(*ids.shape, device="cuda", generator=g)
    fn = lambda: moe_ffn(x, ids, gates, w1, w2, b1, b2, check=False)
    ref = loop_peer(x.double(), ids.long(), *(t.double() for t in (gates, w1, w2, b1, b2)))
    err = float((fn().double() - ref).norm() / ref.norm())
    row = {"whole": timer(fn) * 1e3, "err": err}
    per = {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(15):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and "moe" in ev.name:
            per.setdefault(ev.name.split("(")[0], []).append(ev.device_time)
    return {**row, **{k.replace("moe_", ""): statistics.median(v) for k, v in per.items()}}

rows = {
    "zipf E64": case(64, routing(T, 64, 0)),
    "zipf E128": case(128, routing(T, 128, 0)),
    "zipf E64 top-2": case(64, routing(T, 64, 0, topk=2)),
    "64 an expert": case(64, (np.arange(T) % 64)[:, None]),
    "8 an expert": case(64, (np.arange(512) % 64)[:, None]),
    "one expert": case(64, np.zeros((T, 1), np.int64)),
}
print("RESULT", json.dumps(rows))
'''


def show(case: str, row: dict) -> str:
    kernels = "  ".join(f"{k} {v:6.1f}" for k, v in row.items() if k not in ("whole", "err"))
    return f"{case:16s} whole {row['whole']:6.1f} us  {kernels}  err {row['err']:.1e}"


if __name__ == "__main__":
    sys.exit(ab.main(CHILD, show, __doc__))
