"""Sweep tile-kernel schedules (BN, BK, warps, stages) per kernel mode on this GPU: fp16
4096^3, CUDA events, median, L2 flushed. Prints the best per mode; the defaults in
pitgen/lower.py follow these results (see docs/performance.md)."""
from __future__ import annotations

import argparse
import itertools

import torch

import pitgen
from pitgen.bench import Timer
from pitgen.bench.workloads import block_mask
from pitgen.errors import PlanError
from pitgen.lower import Layout, Schedule, gemm_form, lower
from pitgen.operands import as_operand
from pitgen.ops.matmul import MATMUL, GemmCall, Launcher
from pitgen.runtime import precompile

EXPR = "C[m,n] += A[m,k] * B[k,n]"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    n = args.size
    op = pitgen.parse(EXPR)
    form = gemm_form(op, "A")
    timer = Timer(args.repeats)
    B = torch.randn(n, n, device="cuda", dtype=torch.float16)
    A0 = torch.randn(n, n, device="cuda", dtype=torch.float16)
    dense = timer(lambda: torch.matmul(A0, B))
    print(f"cuBLAS {dense:.4f} ms ({2 * n**3 / dense / 1e9:.0f} TFLOP/s)")
    modes = [("dense", None, (), 1.0), ("micro", "k", (128, 1), 1.0), ("micro", "k", (64, 1), 1.0),
             ("micro", "k", (32, 1), 0.1), ("micro", "k", (128, 1), 0.1)]
    grid = [Schedule(bn=bn, bk=bk, wm=wm, wn=wn, stages=st) for bn, bk, (wm, wn), st in
            itertools.product((128, 256), (32, 64), ((2, 2), (2, 4), (4, 2), (1, 4)), (3, 4))]
    # compile every (mode, schedule) first, in parallel (nvcc runs outside the CUDA context)
    layout = Layout(n, n, n, (n, 1), (n, 1), (n, 1))
    specs = []
    for kind, axis, shape, _ in modes:
        for sch in grid:
            try:
                specs.append(lower(op, "A", kind, axis, shape, "float16", layout, schedule=sch))
            except PlanError:
                pass
    precompile(MATMUL.source(sp.context()) for sp in specs)
    print(f"compiled {len(specs)} variants")
    for kind, axis, shape, density in modes:
        A = A0 * block_mask((n, n), shape or (1, 1), density).half()
        ops = {"A": as_operand("A", A), "B": as_operand("B", B)}
        results = []
        for sch in grid:
            try:
                L = Launcher(op, form, [(kind, axis, shape)], "float16", ops, None, False, sch,
                             vendor_dense=False)
            except PlanError:  # the schedule does not fit this mode's tile
                continue
            except Exception as e:  # e.g. more shared memory than the device has
                print(f"  skip {sch}: {type(e).__name__}: {str(e)[:80]}")
                continue
            call = GemmCall(L, A, B, None)
            call.build_index(None)
            t = timer(lambda: call.compute(None))
            results.append((t, sch))
        results.sort(key=lambda r: r[0])
        print(f"{kind} {shape} density {density}: best of {len(results)}")
        for t, sch in results[:4]:
            print(f"   {t:.4f} ms  ({dense / t * density:.2f} of cuBLAS-equivalent)  {sch}")


if __name__ == "__main__":
    main()
