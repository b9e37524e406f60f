"""pitgen's sparse matmul against dense cuBLAS (``pitgen bench matmul``): C = A @ B in fp16,
A sparse in units of a granularity at several sparsities. The index build and the tile kernel
are timed apart, then the whole call with its host time; one read of A (a streaming probe)
and a device copy of it are the index build's yardsticks, and first-compile / cached-load
times are taken in fresh processes (a module cache warm in this process would hide them).

Each cell is judged against its floor, measured in the same run: the largest of the tensor
work (the non-zero units' share of dense cuBLAS time), the compulsory HBM bytes at the copy
rate and the gathered bytes at a measured gather rate (:func:`traffic`). At 128 x 128 blocks,
the block-sparse peers' own granularity, stk's kernel (``stk.ops.dsd``, MegaBlocks') is timed
alone beside pitgen's whole call, its conversion not counted."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from .report import fmt, fmt_e, md_table, rel_err, write_json

if TYPE_CHECKING:
    from .suite import Run

EXPR = "C[m,n] += A[m,k] * B[k,n]"


def traffic(nonzero_units: int, active_k: int, unit: tuple[int, int], m: int, k: int, n: int,
            elem: int) -> tuple[int, int]:
    """(HBM bytes, gathered bytes) that any kernel of C[m,n] = A[m,k] B[k,n] must move when A
    is non-zero in ``nonzero_units`` aligned units of ``unit`` (rows x cols, clipped to A) whose
    columns cover ``active_k`` k-units. HBM: A's non-zero units, B's rows that some unit uses,
    C written once. Gathered: the B rows the units pull through L2 at the units' granularity,
    one B row of N per unit column per unit (PIT's L2 model: rows / unit height x non-zero k x
    N); for units one row tall (1 x w) the row-owner kernels share B between rows, so only the
    distinct k-units count, each once."""
    uh, uw = min(unit[0], m), min(unit[1], k)
    a_bytes = nonzero_units * uh * uw * elem
    b_rows = min(active_k * uw, k)
    hbm = a_bytes + b_rows * n * elem + m * n * elem
    gathered = (b_rows if uh == 1 else nonzero_units * uw) * n * elem
    return hbm, gathered


def floor(mask: Any, n: int, elem: int, kind: str, shape: tuple[int, ...], dense_ms: float,
          copy_rate: float, gather_rate: float) -> dict[str, float]:
    """The floors (ms) of the plan that runs, over its units of ``shape`` in the host ``mask`` of
    A (B has ``n`` columns of ``elem`` bytes): tensor share of dense time, compulsory HBM bytes
    at ``copy_rate``, gathered B rows at ``gather_rate`` (rates in bytes per ms). A dense plan's
    floor is dense cuBLAS time: the chosen algorithm is what a floor judges."""
    from ..index import tile_grid

    if kind == "dense":
        return {"tensor": dense_ms}
    m, k = mask.shape
    unit = (min(shape[0], m), min(shape[1], k))
    grid = tile_grid(mask, unit)
    hbm, gathered = traffic(int(grid.sum()), int(grid.any(0).sum()), unit, m, k, n, elem)
    return {"tensor": float(grid.mean()) * dense_ms, "hbm": hbm / copy_rate,
            "gather": gathered / gather_rate}


def stk_kernel(timer: Any, a: Any, b: Any, ref: Any) -> dict:
    """stk's block-sparse product alone on A in 128 x 128 blocks (converted once beforehand,
    not timed), with its error; empty without stk."""
    try:
        import stk
    except ImportError:
        return {}
    s = stk.ops.to_sparse(a, blocking=128)
    return {"stk_ms": timer(lambda: stk.ops.dsd(s, b)), "stk_rel_err": rel_err(stk.ops.dsd(s, b), ref)}


def compile_times(micro: str) -> dict:
    """First compile (empty cache) and cached load, each in a new process."""
    code = (f"import time, torch, pitgen; A = torch.randn(256, 256, device='cuda', "
            f"dtype=torch.float16); k = pitgen.compile({EXPR!r}, sparse='A', "
            f"micro_tile={micro!r}); t = time.perf_counter(); k.prepare(A, A); "
            f"print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, PITGEN_CACHE=cache)
        first, cached = (float(subprocess.check_output([sys.executable, "-c", code],
                                                       env=env).split()[-1]) for _ in range(2))
    return {"first_compile_s": first, "cached_load_s": cached}


def run(r: Run) -> int:
    import torch

    import pitgen

    from .report import Progress
    from .probe import gather_rate, read_ms
    from .workloads import block_mask

    n, timer, quick = r.args.size, r.timer, r.args.quick
    grans = r.args.granularity or (["32x1", "32x64", "128x128"] if quick
                                   else ["32x1", "1x64", "32x64", "128x128"])
    sps = [float(s) for s in r.args.sparsity or ((0, 90, 99) if quick else (0, 50, 90, 95, 99))]
    gen = torch.Generator(device="cuda").manual_seed(0)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=gen)
    a0 = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=gen)
    dense_ms = timer(lambda: torch.matmul(a0, b))
    dst = torch.empty_like(a0)
    copy_ms = timer(lambda: dst.copy_(a0))
    copy_rate = 2 * a0.nbytes / copy_ms               # bytes read + written per ms
    read = read_ms(timer, a0)                         # A streamed once: the index pass's floor
    gather = gather_rate(timer, b, 8 * n)   # B's rows, 256-byte slabs of 8 MB, 8 and 72 per row
    progress = Progress(len(grans) * len(sps))
    rows = []
    for gran in grans:
        unit = tuple(int(v) for v in gran.split("x"))
        for sp in sps:
            progress.step(f"matmul {gran} {sp:g}%")
            mask = block_mask((n, n), unit, 1 - sp / 100, gen)
            a = a0 * mask.to(a0.dtype)
            ref = a.float() @ b.float()
            ideal = (1 - sp / 100) * dense_ms
            host_mask = mask.cpu().numpy()
            peer = stk_kernel(timer, a, b, ref) if gran == "128x128" else {}
            for micro in (gran, "auto"):
                kern = pitgen.compile(EXPR, sparse="A", dtype="float16", micro_tile=micro)
                out = torch.empty(n, n, device="cuda", dtype=torch.float16)
                call = kern.prepare(a, b, out=out)
                index_ms = timer(lambda: call.build_index(None))
                call.build_index(None)
                compute_ms = timer(lambda: call.compute(None))
                total = timer.both(lambda: kern(a, b, out=out), calls=50)
                c = kern.plan.choice
                floors = floor(host_mask, n, a0.element_size(), c.kind, c.shape, dense_ms,
                               copy_rate, gather)
                bound = max(floors, key=floors.get)
                rows.append({
                    "granularity": gran, "sparsity": sp, "micro_tile": micro,
                    "choice": f"{c.kind} {'x'.join(map(str, c.shape))}", "index_ms": index_ms,
                    "compute_ms": compute_ms, "total_ms": total.gpu_ms, "host_ms": total.wall_ms,
                    "dense_ms": dense_ms, "ideal_ms": ideal, "vs_dense": dense_ms / total.gpu_ms,
                    "vs_ideal": total.gpu_ms / max(ideal, 1e-9),
                    "floor_ms": floors[bound], "floor_bound": bound,
                    "vs_floor": total.gpu_ms / floors[bound],
                    "index_vs_copy": index_ms / copy_ms, "index_vs_read": index_ms / read,
                    "rel_err": rel_err(out, ref), **peer})
                if peer and peer["stk_rel_err"] <= 1e-2:   # a wrong peer is not a yardstick
                    rows[-1]["vs_stk"] = peer["stk_ms"] / total.gpu_ms
                x = rows[-1]
                print(f"{gran:>6} {sp:5.1f}% {micro:>6} ({x['choice']:>12}): index {index_ms:.4f} "
                      f"compute {compute_ms:.4f} total {total.gpu_ms:.4f} ms | dense "
                      f"{dense_ms:.4f} | {x['vs_dense']:.2f}x vs dense | err {x['rel_err']:.1e}",
                      flush=True)
    meta = {**r.meta, "size": n, "dense_ms": dense_ms, "copy_ms": copy_ms, "read_ms": read,
            "copy_gb_s": copy_rate / 1e6, "gather_gb_s": gather / 1e6,
            "dense_tflops": 2 * n**3 / dense_ms / 1e9, **compile_times("32x1")}
    name = "matmul" if n == 4096 else f"matmul-{n}"   # the default size keeps the plain name
    write_json(r.out / f"{name}.json", {"meta": meta, "rows": rows})
    lines = [f"# Sparse matmul, fp16, {n}^3, {meta['device']}", "",
             f"dense cuBLAS {dense_ms:.4f} ms ({meta['dense_tflops']:.0f} TFLOP/s); copy of A "
             f"{copy_ms:.4f} ms ({copy_rate / 1e9:.2f} TB/s); one read of A {read:.4f} ms "
             "(pitgen's probe streaming it in 16-byte loads: the index pass's floor; after "
             "the L2 flush a read also writes back the dirty lines it evicts); gather of B's rows "
             f"{gather / 1e9:.2f} TB/s (pitgen's probe: 256-byte slabs of random rows within an 8 "
             "MB slab of B, the marginal rate between 8 and 72 reads a row); first compile "
             f"{meta['first_compile_s']:.2f} s, cached load {meta['cached_load_s']:.3f} s; torch "
             f"{meta['torch']}, CUDA {meta['cuda']}; median of {timer.repeats}, L2 flushed; "
             "host time per call measured apart (eager, back to back). Floor of the chosen plan's "
             "algorithm = the largest of: its non-zero units' share of dense time (tensor), "
             "compulsory bytes at the copy rate (hbm), B rows gathered per unit at the gather "
             "rate (gather); a dense choice's floor is dense cuBLAS. stk: its kernel alone "
             "(`stk.ops.dsd`, 128x128 blocks, conversion not counted) and its time over "
             "pitgen's whole call (target >= 3x)", ""]
    lines += md_table(
        ["granularity", "sparsity", "micro_tile", "choice", "index ms", "compute ms", "total ms",
         "dense / total", "total / ideal", "floor ms (bound)", "total / floor", "index / copy",
         "index / read", "rel err", "host us/call", "stk kernel ms", "stk / total"],
        [[x["granularity"], f"{x['sparsity']:.0f}%", x["micro_tile"], x["choice"],
          fmt(x["index_ms"], 4), fmt(x["compute_ms"], 4), fmt(x["total_ms"], 4),
          fmt(x["vs_dense"], 2), fmt(x["vs_ideal"], 2),
          f"{fmt(x['floor_ms'], 4)} ({x['floor_bound']})", fmt(x["vs_floor"], 2),
          fmt(x["index_vs_copy"], 2), fmt(x["index_vs_read"], 2),
          fmt_e(x["rel_err"]), f"{1e3 * x['host_ms']:.0f}", fmt(x.get("stk_ms"), 4),
          fmt(x.get("vs_stk"), 2)] for x in rows])
    (r.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any(x["rel_err"] > 1e-2 for x in rows) else 0
