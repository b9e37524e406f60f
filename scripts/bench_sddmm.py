"""SDDMM S = Q Kᵀ ⊙ mask at 4096 x 4096 x D: pitgen's tiles on each mainloop the device has
(wgmma and mma.sync on Hopper, in one process) against cuBLAS's dense product masked afterwards,
whole calls (index included), fp16, a new mask every call.

    python3 scripts/bench_sddmm.py [--size 4096] [--d 4096,64] [--density 0.1]

Floor of a cell, each rate measured in the same run: the largest of the listed tiles' share of
the dense product's time, the compulsory bytes (Q and K read once, the mask read, S zeroed and
written) at the copy rate, and the rows the tiles gather (each CTA's 64 listed K rows and TH Q
rows, D deep: L2 traffic) at the gather rate of pitgen's probe (pitgen.bench.probe)."""
from __future__ import annotations

import argparse
import contextlib

import torch

from pitgen import lower
from pitgen.bench.probe import gather_rate
from pitgen.bench.timing import Timer
from pitgen.ops import sddmm as S
from pitgen.runtime import device_arch


@contextlib.contextmanager
def mainloop(name: str):
    """Tiles on ``name``: "mma_sync" turns Hopper's wgmma off for the calls inside."""
    saved = lower.WGMMA_ARCHS
    if name == "mma_sync":
        lower.WGMMA_ARCHS = ()
    S.plan_sddmm.cache_clear()
    try:
        yield
    finally:
        lower.WGMMA_ARCHS = saved
        S.plan_sddmm.cache_clear()


def masks(n: int, tile: tuple[int, int], density: float, count: int = 4) -> list[torch.Tensor]:
    """``count`` masks whose (th, tw) tiles are on with probability ``density`` (whole tiles)."""
    th, tw = tile
    out = []
    for _ in range(count):
        grid = torch.rand(-(-n // th), -(-n // tw), device="cuda") < density
        out.append(grid.repeat_interleave(th, 0).repeat_interleave(tw, 1)[:n, :n].contiguous())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--d", default="4096,64", help="reduction lengths D")
    ap.add_argument("--density", type=float, default=0.1)
    args = ap.parse_args()
    n = args.size
    timer = Timer(repeats=20)
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    copy_ms = timer(lambda: big.clone())
    copy_rate = 2 * big.numel() / (copy_ms * 1e-3)   # bytes read + written per second
    loops = ["wgmma", "mma_sync"] if device_arch() in lower.WGMMA_ARCHS else ["mma_sync"]
    print(f"{torch.cuda.get_device_name()}; {n} x {n}, fp16, whole calls, median of 20; "
          f"copy {copy_rate / 1e12:.2f} TB/s")
    print("| D | tile | listed | " + " | ".join(f"{m} ms" for m in loops)
          + " | dense QKᵀ ⊙ M ms | gather TB/s | floor ms | best / dense | best / floor |")
    print("|---|---|---:|" + "---:|" * len(loops) + "---:|---:|---:|---:|---:|")
    rates = {}
    for d in (int(x) for x in args.d.split(",")):
        q = torch.randn(n, d, device="cuda", dtype=torch.float16)
        k = torch.randn(n, d, device="cuda", dtype=torch.float16)
        rates[d] = gather_rate(timer, k, 8 * n, piece=128) * 1e3   # bytes per second
        out = torch.empty(n, n, device="cuda", dtype=torch.float16)
        dense_ms = timer(lambda m: torch.mul(q @ k.t(), m), inputs=[(m,) for m in masks(n, (1, 1), 1.0, 1)])
        for tile in ((32, 1), (1, 32), (64, 64), (16, 16)):
            ms = masks(n, tile, args.density)
            th, tw = tile
            listed = sum(float(m[::th, ::tw].float().mean()) for m in ms) / len(ms)
            times = {}
            ref = (q.double() @ k.double().t()) * ms[0]
            for loop in loops:
                with mainloop(loop):
                    S.sddmm(q, k, ms[0], tile, out=out)
                    err = ((out.double() - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, (loop, tile, err)
                    times[loop] = timer(lambda m: S.sddmm(q, k, m, tile, out=out),
                                        inputs=[(m,) for m in ms])
            # the kernels' view: (1, L) tiles run as (L, 1) tiles of Sᵀ
            kth, ktw = (th, tw) if th > 1 else (tw, th)
            ctas = listed * (n // th) * (n // tw) / (S.BN // ktw)
            gathered = ctas * (S.BN + kth) * d * 2
            moved = 2 * q.numel() * 2 + n * n + 2 * n * n * 2
            floor = max(listed * dense_ms, moved / copy_rate * 1e3, gathered / rates[d] * 1e3)
            best = min(times.values())
            print(f"| {d} | {th}×{tw} | {listed:.3f} | "
                  + " | ".join(f"{times[m]:.4f}" for m in loops)
                  + f" | {dense_ms:.4f} | {rates[d] / 1e12:.2f} | {floor:.4f} | {best / dense_ms:.2f}× "
                  f"| {best / floor:.2f}× |")


if __name__ == "__main__":
    main()
