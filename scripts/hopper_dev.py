"""Hopper tile kernel: correctness of the wgmma kernel against float64 and the mma.sync kernel,
then GPU times of both against cuBLAS (pitgen.bench.timing.Timer). Prints one table.

    python3 scripts/hopper_dev.py            correctness, then times
    python3 scripts/hopper_dev.py --speed    times only
    python3 scripts/hopper_dev.py --once     one launch per wgmma variant (compute-sanitizer)
    python3 scripts/hopper_dev.py --profile  the 90% 128x128-block case twice (ncu)
    --only=MICRO[,MICRO]: time only the cases of these granularities (e.g. --only=128x128)
    --densities=D[,D]: the 128x128-block densities to time (default 0.5,0.1)
    --sizes=N[,N]: the cubes to time (default 4096,8192)
The wgmma kernel is checked and timed with both consumer schedules (lower.PINGPONG): split
(the two consumer warpgroups share each tile) and ping-pong (they take alternate tiles).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

import pitgen
from pitgen import lower
from pitgen.bench.timing import Timer
from pitgen.bench.workloads import block_mask

EXPR = "C[m,n] += A[m,k] * B[k,n]"
SCHEDULES = ("pingpong", "split", "mma_sync")
BOXES = ("dense", "128x128", "64x128")  # granularities the wgmma kernel runs


@contextmanager
def schedule(name: str):
    """Plans made inside run the wgmma kernel with ``name``'s consumers, or mma.sync."""
    saved = lower.WGMMA_ARCHS, lower.PINGPONG
    if name == "mma_sync":
        lower.WGMMA_ARCHS = ()
    else:
        lower.PINGPONG = "always" if name == "pingpong" else "never"
    try:
        yield
    finally:
        lower.WGMMA_ARCHS, lower.PINGPONG = saved


def check(dt, micro, M, N, K, density, gen, layout="AB"):
    tdt = getattr(torch, dt)
    a = torch.randn(M, K, device="cuda", dtype=tdt, generator=gen)
    if micro != "dense":
        unit = tuple(int(v) for v in micro.split("x"))
        a = a * block_mask((M, K), unit, density, gen).to(tdt)
    b = torch.randn(K, N, device="cuda", dtype=tdt, generator=gen)
    if layout == "AtB":
        a = a.t().contiguous().t()
    if layout == "ABt":
        b = b.t().contiguous().t()
    kern = pitgen.compile(EXPR, sparse="A", dtype=dt, micro_tile=micro, vendor_dense=False)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=tdt)
    call = kern.prepare(a, b, out=out)
    kern(a, b, out=out)
    torch.cuda.synchronize()
    ref = a.double() @ b.double()
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    bad = int((~torch.isfinite(out)).sum())
    g = call.L.spec.gemm
    ml = "mma_sync" if g.mainloop == "mma_sync" else "pingpong" if g.pingpong else "split"
    return ml, err, bad, kern, a, b, out


def once() -> int:
    """One launch of each wgmma variant on ragged shapes (for compute-sanitizer)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    bad = 0
    for name in SCHEDULES[:2]:
        for micro in ("dense", "128x128", "64x64"):
            for layout in ("AB", "AtB", "ABt"):
                with schedule(name):
                    ml, err, nonfinite, *_ = check("float16", micro, 200, 136, 328, 0.5, gen, layout)
                bad += ml != name or err > 1e-2 or nonfinite > 0
                print(micro, layout, ml, f"{err:.1e}", nonfinite)
    return bad


def profile() -> int:
    """Two calls of the 90%-sparse 128x128-block case at 4096^3, for
    ``ncu --kernel-name pit_gemm_sm90 --launch-skip 1 --launch-count 1``."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(2):
        ml, err, bad, *_ = check("float16", "128x128", 4096, 4096, 4096, 0.1, gen)
    print(ml, f"{err:.1e}", bad)
    return int(ml == "mma_sync" or err > 1e-2 or bad > 0)


def main() -> int:
    if "--once" in sys.argv:
        return once()
    if "--profile" in sys.argv:
        return profile()
    gen = torch.Generator(device="cuda").manual_seed(0)
    timer = Timer(repeats=30)
    fails = 0
    print(torch.cuda.get_device_name(), file=sys.stderr)
    # correctness: odd shapes, layouts, granularities, densities 0 / 0.1 / 1
    for dt in (() if "--speed" in sys.argv else ("float16", "bfloat16")):
        for micro in ("dense", "128x128", "64x128", "128x1", "64x1"):
            for (M, N, K) in ((256, 256, 256), (200, 136, 328), (513, 1000, 777), (64, 8, 64)):
                for layout, density, name in ((lay, d, n) for lay in ("AB", "AtB", "ABt")
                                              for d in ((1.0,) if micro == "dense" else (0.0, 0.1, 1.0))
                                              for n in SCHEDULES[:1 + (micro in BOXES)]):
                    try:
                        with schedule(name):
                            ml, err, bad, *_ = check(dt, micro, M, N, K, density, gen, layout)
                    except pitgen.PitgenError as e:
                        print(f"skip {dt} {micro} {M}x{N}x{K} {layout}: {e}")
                        continue
                    ok = bad == 0 and err < 1e-2
                    fails += not ok
                    if not ok or (M, N, K) == (513, 1000, 777):
                        print(f"{'ok ' if ok else 'BAD'} {dt} {micro:>7} {M}x{N}x{K} {layout} "
                              f"d={density} {ml} err={err:.2e} nonfinite={bad}")
    print(f"correctness failures: {fails}")
    # speed
    def listed(flag: str, default: str) -> list[str]:
        return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(flag + "=")), default).split(",")

    densities = [float(d) for d in listed("--densities", "0.5,0.1")]
    for n in (int(v) for v in listed("--sizes", "4096,8192")):
        for dt in ("float16", "bfloat16"):
            tdt = getattr(torch, dt)
            a0 = torch.randn(n, n, device="cuda", dtype=tdt, generator=gen)
            b = torch.randn(n, n, device="cuda", dtype=tdt, generator=gen)
            dense = timer(lambda: torch.mm(a0, b))
            print(f"{n}^3 {dt} cuBLAS {dense:.4f} ms ({2 * n ** 3 / dense / 1e9:.0f} TFLOP/s)")
            only = listed("--only", "")
            for micro, dens in (("dense", 1.0), *(("128x128", d) for d in densities),
                                ("128x1", 0.1), ("64x1", 0.1)):
                if only != [""] and micro not in only:
                    continue
                for name in SCHEDULES if micro in BOXES else SCHEDULES[2:]:
                    with schedule(name):
                        ml, err, bad, kern, a, bb, out = check(dt, micro, n, n, n, dens, gen)
                        call = kern.prepare(a, bb, out=out)
                        call.build_index(None)
                        comp = timer(lambda: call.compute(None))
                        index = timer(lambda: call.build_index(None))
                        both = timer.both(lambda: kern(a, bb, out=out), calls=30)
                        whole = both.gpu_ms
                    print(f"  {micro:>7} d={dens:<4} {ml:>8}: compute {comp:.4f} whole {whole:.4f} ms "
                          f"= {whole / dense:.2f}x cuBLAS time (compute {dense / comp:.2f}x speed) "
                          f"index {index:.4f} host {both.wall_ms:.4f} err {err:.1e} nonfinite {bad}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
