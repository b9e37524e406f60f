"""Sweep the attention forward's pipeline depth (stages) and register budget (CTAs per SM) per
head dim on this GPU, for the mainloop this device runs (wgmma on sm_90, mma.sync before; BM
stays 64: the index's per-key row masks are 64-bit): fp16, B=1, 12 heads, sequence 4096, the
masks of ``pitgen bench attention``; compute-only time (the index built once per variant), CUDA
events, median, L2 flushed. Prints one line per variant; pitgen/ops/attention.py's STAGES and
MIN_BLOCKS (mma.sync) or MIN_BLOCKS_WGMMA follow the results (docs/attention.md).

    python scripts/tune_attention.py [--repeats N]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from pitgen import cache
from pitgen.bench import Timer
from pitgen.bench.attention import B, H, S, masks
from pitgen.ops import attention as A
from pitgen.runtime import device_arch

#: (stages, CTAs per SM) per head dim; those that do not fit shared memory are reported
VARIANTS = {64: [(2, 4), (2, 3), (3, 3), (4, 2), (3, 2)], 128: [(2, 3), (2, 2), (3, 2), (4, 2)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    timer = Timer(args.repeats)
    wgmma = A.plan_attention(B, H, S, S, 64, "float16", (S, S), 0, device_arch()).wgmma
    ctas = A.MIN_BLOCKS_WGMMA if wgmma else A.MIN_BLOCKS
    print(torch.cuda.get_device_name(), "wgmma" if wgmma else "mma.sync")
    ms = {name: torch.from_numpy(m).cuda() for name, m in masks(np.random.default_rng(0)).items()}
    defaults = dict(A.STAGES), dict(ctas)
    try:
        for d in A.HEAD_DIMS:
            q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.float16)
                       for _ in range(3))
            dense = timer(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
            print(f"D={d}: dense SDPA {dense:.4f} ms")
            ref: dict[str, torch.Tensor] = {}
            for stages, blocks in VARIANTS[d]:
                A.STAGES[d], ctas[d] = stages, blocks
                cache.clear()   # the plans (and their modules' bindings) of the last variant
                try:
                    cells = []
                    for name, m in ms.items():
                        idx = A.block_index(q, k, v, m)
                        out = A.sparse_attention(q, k, v, m, index=idx)
                        ref.setdefault(name, out.float())
                        err = float((out.float() - ref[name]).norm() / ref[name].norm())
                        t = timer(lambda: A.sparse_attention(q, k, v, m, index=idx))
                        cells.append(f"{name[:8]} {t:.4f} ({t / dense:.2f}x, err {err:.0e})")
                    print(f"  stages {stages} CTAs/SM {blocks}: " + " | ".join(cells), flush=True)
                except Exception as e:  # noqa: BLE001 - a variant that does not fit is reported
                    print(f"  stages {stages} CTAs/SM {blocks}: {type(e).__name__}: {e}"[:200])
    finally:
        A.STAGES.update(defaults[0])
        ctas.update(defaults[1])
        cache.clear()


if __name__ == "__main__":
    main()
