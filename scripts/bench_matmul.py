"""Sparse-matmul benchmark against dense cuBLAS (torch.matmul), on a GPU.

C = A @ B in fp16, A sparse in micro-tiles of a given granularity at several sparsities; times
the index build and the tile kernel separately (CUDA events, warm-up, median of --repeats runs,
L2 flushed before each run by writing a 256 MB buffer), plus a device-to-device copy of A (the
index build's yardstick) and compile / cached-load times in fresh processes. Writes JSON and a
Markdown table to --out and prints the table.

GPU time is measured with scripts/bench.py's Timer: the host's launches are hidden behind a
spin kernel queued ahead of the start event, so the events bracket only device work. Host launch overhead per call is
reported apart ("host us/call").
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

import pitgen
from bench import Timer, host_ms  # the suite's timing method, shared


def make_mask(shape, unit, density, gen):
    grid = torch.rand((-(-shape[0] // unit[0]), -(-shape[1] // unit[1])), generator=gen,
                      device="cuda") < density
    return grid.repeat_interleave(unit[0], 0).repeat_interleave(unit[1], 1)[: shape[0], : shape[1]]


def compile_times(expr: str, micro: str) -> dict:
    """First compile (empty cache) and cached load, each in a new process."""
    code = (f"import time, torch, pitgen; A = torch.randn(256, 256, device='cuda', dtype=torch.float16);"
            f"k = pitgen.compile({expr!r}, sparse='A', micro_tile={micro!r}); t = time.perf_counter();"
            f"k.prepare(A, A); print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, PITGEN_CACHE=cache)
        first = float(subprocess.check_output([sys.executable, "-c", code], env=env).split()[-1])
        cached = float(subprocess.check_output([sys.executable, "-c", code], env=env).split()[-1])
    return {"first_compile_s": first, "cached_load_s": cached}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--sparsity", default="0,50,90,95,99")
    ap.add_argument("--granularity", default="32x1,1x64,32x64")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="docs/bench")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    n = args.size
    timer = Timer(args.repeats)
    gen = torch.Generator(device="cuda").manual_seed(0)
    expr = "C[m,n] += A[m,k] * B[k,n]"
    B = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=gen)
    A0 = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=gen)
    dense_ms = timer(lambda: torch.matmul(A0, B))
    copy_dst = torch.empty_like(A0)
    copy_ms = timer(lambda: copy_dst.copy_(A0))
    rows = []
    for gran in args.granularity.split(","):
        unit = tuple(int(v) for v in gran.split("x"))
        for sp in (float(s) for s in args.sparsity.split(",")):
            A = A0 * make_mask((n, n), unit, 1 - sp / 100, gen).to(A0.dtype)
            ref = A.float() @ B.float()
            for micro in (gran, "auto"):
                kern = pitgen.compile(expr, sparse="A", dtype="float16", micro_tile=micro)
                out = torch.empty(n, n, device="cuda", dtype=torch.float16)
                call = kern.prepare(A, B, out=out)
                idx_ms = timer(lambda: call.build_index(None))
                call.build_index(None)
                comp_ms = timer(lambda: call.compute(None))
                total_ms = timer(lambda: kern(A, B, out=out))
                err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                dense_err = ((torch.matmul(A, B).float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                c = kern.plan.choice
                rows.append({
                    "granularity": gran, "sparsity": sp, "micro_tile": micro,
                    "choice": f"{c.kind} {'x'.join(map(str, c.shape))}",
                    "index_ms": idx_ms, "compute_ms": comp_ms, "total_ms": total_ms,
                    "dense_ms": dense_ms, "ideal_ms": (1 - sp / 100) * dense_ms,
                    "vs_dense": dense_ms / total_ms,
                    "vs_ideal": total_ms / max((1 - sp / 100) * dense_ms, 1e-9),
                    "index_vs_copy": idx_ms / copy_ms, "rel_err": err, "dense_rel_err": dense_err,
                    "host_us_per_call": 1e3 * host_ms(lambda: kern(A, B, out=out), 50),
                })
                r = rows[-1]
                print(f"{gran:>6} {sp:5.1f}% {micro:>6} ({r['choice']:>12}): index {idx_ms:.4f} "
                      f"compute {comp_ms:.4f} total {total_ms:.4f} ms | dense {dense_ms:.4f} | "
                      f"x{r['vs_dense']:.2f} vs dense, {r['vs_ideal']:.2f}x ideal | err {err:.1e}",
                      flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "pitgen": pitgen.__version__, "size": n,
            "repeats": args.repeats, "l2_flush": True,
            "dense_ms": dense_ms, "copy_ms": copy_ms,
            "dense_tflops": 2 * n**3 / dense_ms / 1e9,
            "copy_tb_s": 2 * A0.numel() * 2 / copy_ms / 1e9,
            **compile_times(expr, "32x1")}
    with open(os.path.join(args.out, "matmul.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# Sparse matmul, fp16, {n}^3, {meta['device']}", "",
             f"dense cuBLAS {dense_ms:.4f} ms ({meta['dense_tflops']:.0f} TFLOP/s); "
             f"copy of A {copy_ms:.4f} ms ({meta['copy_tb_s']:.2f} TB/s); first compile "
             f"{meta['first_compile_s']:.2f} s, cached load {meta['cached_load_s']:.3f} s; "
             f"torch {meta['torch']}, CUDA {meta['cuda']}; median of {args.repeats}, L2 flushed", "",
             "| granularity | sparsity | micro_tile | choice | index ms | compute ms | total ms | "
             "dense / total | total / ideal | index / copy | rel err | host us/call |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['granularity']} | {r['sparsity']:.0f}% | {r['micro_tile']} | {r['choice']} | "
                     f"{r['index_ms']:.4f} | {r['compute_ms']:.4f} | {r['total_ms']:.4f} | "
                     f"{r['vs_dense']:.2f} | {r['vs_ideal']:.2f} | {r['index_vs_copy']:.2f} | "
                     f"{r['rel_err']:.1e} | {r['host_us_per_call']:.0f} |")
    with open(os.path.join(args.out, "matmul.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
