"""Time the row-owner kernel (micro-tiles 1 x tk along m, fp16, M = N = K = size) against
torch.mm on masks of whole micro-tiles: index build, compute, and both, L2 flushed
(pitgen.bench.timing.Timer); ``--bm/--bn/--bk/--wm/--wn/--stages`` try another schedule; on
Hopper each cell runs the wgmma kernel and the mma.sync one (``--mainloops``), and the products
kernel (``products``: a CTA per group of a k-tile's active rows, gemm_products.cu.j2).
``--apart`` also times each launch of the call on its own (CUDA events around each, the host's
launches hidden behind a spin, L2 flushed before each call): the products kernel's finishing
pass clears the row table its index wrote, so its three kernels are timed only this way.

    python3 scripts/bench_rows.py                       # 1x64 at 90% and 99%, 4096^3
    python3 scripts/bench_rows.py --bm 128 --bn 128 --stages 3
    python3 scripts/bench_rows.py --sparsity 99 --mainloops products --apart
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import torch

import pitgen
from pitgen.bench.timing import Timer
from pitgen.bench.workloads import block_mask
from pitgen import lower
from pitgen.lower import Schedule, gemm_form
from pitgen.operands import as_operand
from pitgen.ops.matmul import GemmCall, Launcher

EXPR = "C[m,n] += A[m,k] * B[k,n]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--tk", type=int, default=64, help="micro-tile extent along k (default 64)")
    ap.add_argument("--sparsity", default="90,99", help="percent, comma-separated")
    ap.add_argument("--mainloops", default="wgmma,mma_sync,products",
                    help="comma-separated: wgmma (the row-owner kernel on Hopper where the device "
                         "has it), mma_sync (the row-owner kernel on mma.sync), products")
    for knob in ("bm", "bn", "bk", "wm", "wn", "stages"):
        ap.add_argument(f"--{knob}", type=int)
    ap.add_argument("--apart", action="store_true", help="also time each launch on its own")
    args = ap.parse_args()
    n, op = args.size, pitgen.parse(EXPR)
    form = gemm_form(op, "A")
    schedule = Schedule(**{k: getattr(args, k) for k in ("bm", "bn", "bk", "wm", "wn", "stages")})
    gen = torch.Generator(device="cuda").manual_seed(0)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=gen)
    a0 = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=gen)
    timer = Timer(repeats=20)
    dense = timer(lambda: torch.mm(a0, b))
    for sp in (float(s) for s in args.sparsity.split(",")):
        a = a0 * block_mask((n, n), (1, args.tk), 1 - sp / 100, gen).to(a0.dtype)
        out = torch.empty_like(a0)
        ops = {"A": as_operand("A", a), "B": as_operand("B", b)}
        ref = a.float() @ b.float()
        for mainloop in args.mainloops.split(","):
            archs = lower.WGMMA_ARCHS
            if mainloop == "mma_sync":
                lower.WGMMA_ARCHS = ()
            sched = replace(schedule, rows="products") if mainloop == "products" else schedule
            try:
                launcher = Launcher(op, form, [("micro", "m", (1, args.tk))], "float16", ops,
                                    as_operand("out", out), False, sched)
            finally:
                lower.WGMMA_ARCHS = archs
            # the steady state: the launcher's own index buffers, as SparseKernel.__call__ runs
            call = GemmCall(launcher, a, b, out, reuse=True)
            index = timer(lambda: call.build_index(None))
            total = timer(call.run)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            g = launcher.spec.gemm
            # the products kernel's finishing pass clears the row table its index wrote: its
            # compute cannot be timed apart from the index
            compute = (f"{total - index:.4f} (total - index)" if g.a_mode == "products" else
                       f"{timer(lambda: call.compute(None)):.4f}")
            if args.apart:
                parts = launches_apart(launcher, call.run, timer.flush)
                compute += " [" + ", ".join(f"{k} {v:.4f}" for k, v in parts.items()) + "]"
            print(f"1x{args.tk} {sp:g}% {mainloop} ({g.a_mode}): index {index:.4f} + compute {compute} = "
                  f"{total:.4f} ms, {total / dense:.2f}x dense ({dense:.4f} ms); tile "
                  f"{g.bm}x{g.bn}x{g.bk} {g.wm}x{g.wn} warps {g.stages} stages "
                  f"{g.smem_bytes('float16')} B; err {err:.1e}", flush=True)


def launches_apart(launcher: Launcher, run, flush, repeats: int = 20) -> dict[str, float]:
    """Median ms of each kernel that ``run`` launches through the launcher's module, each between
    two CUDA events; before each call L2 is flushed and a spin keeps the device busy while the
    host queues the call, so that no event waits on the host."""
    mod, rec = launcher.mod, {}
    launch = mod.launch

    def timed(name, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch(name, *args, **kwargs)
        end.record()
        rec.setdefault(name, []).append((start, end))

    mod.launch = timed
    try:
        for _ in range(repeats + 2):
            flush.zero_()
            torch.cuda._sleep(1_000_000)
            run()
        torch.cuda.synchronize()
    finally:
        del mod.launch   # the class's method again
    return {name.removeprefix("pit_"): statistics.median(s.elapsed_time(e) for s, e in pairs[2:])
            for name, pairs in rec.items()}


if __name__ == "__main__":
    main()
