"""The benchmark cells whose targets are missed, one steady-state call each between
cudaProfilerStart/Stop, for Nsight Compute (the numbers docs/performance.md and docs/hopper.md
quote as "the profile"):

    ncu --profile-from-start off --set full --cache-control all -o prof \\
        python3 scripts/profile_cases.py [CASE ...]

Each case is warmed up first (plans made, modules loaded, a call run), so only its own
kernels of one call are profiled; with no CASE, every one. ``device_session.sh ncu`` runs it
under ncu and summarises each kernel's SASS lines (scripts/ncu_summary.py). A plain copy of the 32 MB operand
(``copy``) is the read/write reference the index passes are judged against.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

import pitgen
from pitgen.bench.moe import routing
from pitgen.bench.workloads import block_mask

EXPR = "C[m,n] += A[m,k] * B[k,n]"
N = 4096
#: name: (micro-tile of the mask, density, the plan asked for)
MATMUL = {
    "block128-90": ((128, 128), 0.1, "128x128"),
    "block128-50": ((128, 128), 0.5, "128x128"),
    "k32x1-90": ((32, 1), 0.1, "32x1"),
    "rows1x64-90": ((1, 64), 0.1, "1x64"),
    "rows1x64-99": ((1, 64), 0.01, "auto"),
}
#: name: (attention mask of pitgen.bench.attention.masks, head dim)
ATTENTION = {
    "attn-blocks": ("blocks 128x128, 90% sparse", 64),
    "attn-bigbird": ("BigBird w256 + 16 global + 224 random", 64),
    "attn-bigbird-d128": ("BigBird w256 + 16 global + 224 random", 128),
}
CASES = ("copy", *MATMUL, "moe64", *ATTENTION)


def matmul_case(unit: tuple[int, int], density: float, micro: str):
    """One steady-state call of the fp16 4096^3 product with A masked in ``unit`` blocks."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(N, N, device="cuda", dtype=torch.float16, generator=gen)
    a *= block_mask((N, N), unit, density, gen).half()
    b = torch.randn(N, N, device="cuda", dtype=torch.float16, generator=gen)
    out = torch.empty(N, N, device="cuda", dtype=torch.float16)
    kern = pitgen.compile(EXPR, sparse="A", dtype="float16", micro_tile=micro)
    kern(a, b, out=out)
    print(f"{micro} at {density:.0%}: {kern.plan.choice.label}")
    return lambda: kern(a, b, out=out)


def moe_case():
    """The MoE layer at E = 64, top-1 (T 4096, H 768, F 3072, Zipf routing; no id check)."""
    from pitgen.ops.moe import moe_ffn
    T, H, F, E = 4096, 768, 3072, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.tensor(routing(T, E, 0), device="cuda")
    gates = torch.rand(T, 1, device="cuda", generator=gen)
    x = torch.randn(T, H, device="cuda", dtype=torch.float16, generator=gen)
    w1 = (torch.randn(E, H, F, device="cuda", generator=gen) / np.sqrt(H)).half()
    w2 = (torch.randn(E, F, H, device="cuda", generator=gen) / np.sqrt(F)).half()
    b1 = torch.zeros(E, F, device="cuda", dtype=torch.float16)
    b2 = torch.zeros(E, H, device="cuda", dtype=torch.float16)

    def call():
        return moe_ffn(x, ids, gates, w1, w2, b1, b2, activation="gelu", check=False)
    call()
    return call


def attention_case(mask_name: str, d: int):
    """One forward of the benchmark's attention (B 1, H 12, S 4096, fp16) on a mask."""
    from pitgen.bench.attention import S, masks
    from pitgen.ops.attention import sparse_attention
    mask = torch.from_numpy(masks(np.random.default_rng(0))[mask_name]).cuda()
    q, k, v = (torch.randn(1, 12, S, d, device="cuda", dtype=torch.float16) for _ in range(3))

    def call():
        return sparse_attention(q, k, v, mask)
    call()
    return call


def copy_case():
    """A kernel that reads the 32 MB operand and writes a copy (torch's elementwise add, not
    the copy engine, which ncu does not profile)."""
    a = torch.randn(N, N, device="cuda", dtype=torch.float16)
    out = torch.empty_like(a)
    return lambda: torch.add(a, 0.0, out=out)


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown cases {unknown}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    for name in names or CASES:
        call = copy_case() if name == "copy" else moe_case() if name == "moe64" else \
            attention_case(*ATTENTION[name]) if name in ATTENTION else matmul_case(*MATMUL[name])
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
