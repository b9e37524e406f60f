"""Sweep the attention kernel's pipeline depth (stages) and register budget (CTAs per SM) per
head dim on this GPU (query rows per CTA, BM, stay 64: the index's per-key row masks are 64-bit):
fp16, B=1, 12 heads, sequence 4096, the masks of ``pitgen bench attention``; compute-only time (index built once) and index time, CUDA events,
median, L2 flushed. Prints one line per variant; pitgen/attention.py's BM, STAGES and
MIN_BLOCKS follow the results (docs/attention.md).

    python scripts/tune_attention.py [--repeats N]
"""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import torch

from pitgen.bench import Timer
from pitgen.bench.attention import B, H, S, masks
from pitgen.ops import attention as A
from pitgen.render import render_template
from pitgen.runtime import precompile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    timer = Timer(args.repeats)
    print(torch.cuda.get_device_name())
    ms = {name: torch.from_numpy(m).cuda() for name, m in masks(np.random.default_rng(0)).items()}
    defaults = dict(A.STAGES), dict(A.MIN_BLOCKS), A.BM
    # (query rows per CTA, stages, CTAs per SM); BM stays 64: the index's row masks are 64 bits
    variants = {64: [(64, 2, 4), (64, 2, 3), (64, 3, 3), (64, 3, 4)],
                128: [(64, 2, 2), (64, 3, 2)]}
    # compile every variant in parallel first (the sweep then times kernels, not nvcc)
    plans = [dataclasses.replace(A.plan_attention(B, H, S, S, d, "float16", (S, S)), bm=bm,
                                 stages=s, min_blocks=b) for d in variants for bm, s, b in variants[d]]
    precompile(render_template("attention.cu.j2", **p.context()) for p in plans)
    for d in A.HEAD_DIMS:
        q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.float16) for _ in range(3))
        dense = timer(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        print(f"D={d}: dense SDPA {dense:.4f} ms")
        ref = {}
        for bm, stages, blocks in variants[d]:
            A.BM, A.STAGES[d], A.MIN_BLOCKS[d] = bm, stages, blocks
            try:
                cells = []
                for name, m in ms.items():
                    idx = A.block_index(q, k, v, m)
                    out = A.sparse_attention(q, k, v, m, index=idx)
                    if name not in ref:
                        ref[name] = out.float()
                    err = float((out.float() - ref[name]).norm() / ref[name].norm())
                    t = timer(lambda: A.sparse_attention(q, k, v, m, index=idx))
                    t_idx = timer(lambda: A.block_index(q, k, v, m))
                    cells.append(f"{name[:8]} {t:.4f}+{t_idx:.4f} ({(t + t_idx) / dense:.2f}x, "
                                 f"err {err:.0e})")
                print(f"  bm {bm} stages {stages} min_blocks {blocks}: " + " | ".join(cells),
                      flush=True)
            except Exception as e:  # noqa: BLE001 - a variant that does not fit is reported
                print(f"  bm {bm} stages {stages} min_blocks {blocks}: {type(e).__name__}: {e}"[:200])
    A.BM = defaults[2]
    A.STAGES.update(defaults[0])
    A.MIN_BLOCKS.update(defaults[1])


if __name__ == "__main__":
    main()
