"""Measure the planner's cost profile on this GPU and write it (pitgen/profiles/measured.json by
default; ``load_profile()`` prefers it over the analytic placeholder).

For every kernel kind a whole call is timed (CUDA events, median, L2 flushed) on A[m,k] of
--size^2 (fp16, B --size wide) at several micro-tile/block shapes and densities, less the price
of its index pass (the pass launches ahead of the kernel, which overlaps it by 2-5 us that the
two timed apart would count twice); the planner's own counts (dense tiles, elements of S
computed, elements of S) for each run are fitted by
non-negative least squares to ``time = fixed_ns * dense_tiles + ns_per_element * elements +
walk_ns_per_element * |S| + out_ns_per_element * |C|`` (the walk: what a kernel pays whatever the
density, as the row-owner kernel walks every k-tile of every row block, densities down to 1% pin
it; the output term: what it pays per element of C written, its epilogues and stores, which
A[m,k] at k = --size alone cannot tell from the walk, |S| = |C| there, so every shape is also
timed at k = --size / 4), once per kind and once per shape (``shapes``: one shape's tiles and
elements are proportional, so its fit is ``ns_per_element``, ``walk_ns_per_element`` and
``out_ns_per_element``, except along m, where the dense tiles are the row-owner kernel's steps,
counted per row block, and the elements the micro-tiles' own: its time flattens below 10%
density, where every k-tile of a row block still takes a step; a kind's shapes may run on
different mainloops, 32x32 blocks on mma.sync and 128x128 on wgmma). The dense kernel is also
timed on S with zeros, whose share of its element time saved is ``zeros_discount`` (tensor
cores fed zeros draw less power and the clock holds higher: cuBLAS's 8192^3 product 16% faster
at 90% zeros, H200). The index pass is
priced per element of S, per kind and per shape (the median of their runs), beyond its launch,
which is priced once (``index_fixed_ns``: the pass alone on a 256^2 S less a 16-float fill
alone, the timer's own cost). ``width`` records B's width: the planner scales the kernels'
terms by a product's own. Micro-tiles along m are timed on the row-owner kernel at every
density (the kind's fit is that kernel's: ``pitgen.compile`` would run the sparsest masks on the
products kernel, whose compute cannot be timed without its index); the products kernel gets its
own fit (``products``: whole calls at densities it takes, less the shape's index price, over
elements of S computed and |C|), which the planner weighs against it. The file names the
device it was measured on.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
from importlib import resources

import numpy as np
import torch

import pitgen
from pitgen.bench import Timer
from pitgen.bench.workloads import block_mask
from pitgen.lower import PRODUCTS_EXTENTS, Schedule, gemm_form, products_fit
from pitgen.operands import as_operand
from pitgen.ops.matmul import GemmCall, Launcher
from pitgen.planner import make_plan

EXPR = "C[m,n] += A[m,k] * B[k,n]"
OP = pitgen.parse(EXPR)
KINDS = {  # profile key -> [(micro_tile, S shape)]
    "dense": ["dense"],
    "block": ["32x32", "32x64", "64x64", "128x128"],
    "micro-reduction": ["16x1", "32x1", "64x1", "128x1"],
    "micro-spatial": ["1x16", "1x32", "1x64", "1x128"],
}


#: (k as a fraction of --size, densities) each shape is timed at: the short k tells the output's
#: price from the walk's.
DEPTHS = ((1, (1.0, 0.3, 0.1, 0.05, 0.01)), (4, (1.0, 0.1, 0.01)))
#: Densities the products kernel is fitted at (each within products_fit for every shape timed).
PRODUCTS_DENSITIES = (0.02, 0.01, 0.005)
#: The side of the small S whose index pass prices the pass's launch, one shape per sparse kind.
SMALL, SMALL_SHAPES = 256, ("32x64", "32x1", "1x64")

UNIT_PROFILE = {"device": "unit costs (counts work)", "measured": False, "index_ns_per_element": 0.0,
                "kinds": {k: {"fixed_ns": 0.0, "ns_per_element": 1.0} for k in KINDS}}


def nonnegative_fit(X: np.ndarray, y: np.ndarray) -> tuple[float, ...]:
    """Least squares of y on X's columns with every coefficient >= 0 (a cost model must not
    grow cheaper with work), in relative error (choosing between candidates needs a 20 us time
    as right in proportion as a 900 us one; an absolute fit let the dense runs set the
    intercept, and 64x64 blocks then undercut 128x128 ones at 1% by a third of their real gap):
    the best fit over the subsets of columns whose own fit is non-negative; columns left out
    get 0."""
    X, y = X / y[:, None], np.ones_like(y)
    best, coef = math.inf, (0.0,) * X.shape[1]
    for cols in itertools.chain.from_iterable(
            itertools.combinations(range(X.shape[1]), r) for r in range(1, X.shape[1] + 1)):
        c, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
        err = float(np.sum((X[:, cols] @ c - y) ** 2))
        if (c >= 0).all() and err < best:
            best, coef = err, tuple(float(c[cols.index(i)]) if i in cols else 0.0
                                    for i in range(X.shape[1]))
    return coef


def rows_call(micro: str, A: torch.Tensor, B: torch.Tensor, schedule: Schedule) -> GemmCall:
    """A call of C = A B with micro-tiles ``micro`` along m on the kernel ``schedule`` names
    (``Schedule()``: the row-owner kernel; ``rows="products"``: the products kernel), on its
    launcher's own buffers as the steady state runs it."""
    out = torch.empty(A.shape[0], B.shape[1], device=A.device, dtype=A.dtype)
    ops = {"A": as_operand("A", A), "B": as_operand("B", B)}
    unit = tuple(int(v) for v in micro.split("x"))
    launcher = Launcher(OP, gemm_form(OP, "A"), [("micro", "m", unit)], "float16", ops,
                        as_operand("out", out), False, schedule)
    return GemmCall(launcher, A, B, out, reuse=True)


def timed_call(micro: str, A: torch.Tensor, B: torch.Tensor) -> GemmCall:
    """The call the profile times for ``micro``: micro-tiles along m (1 x n) on the row-owner
    kernel whatever the density, every other shape as ``pitgen.compile`` runs it."""
    if micro.startswith("1x"):
        return rows_call(micro, A, B, Schedule())
    return pitgen.compile(EXPR, sparse="A", dtype="float16", micro_tile=micro).prepare(A, B)


def index_launch(A0: torch.Tensor, B: torch.Tensor, gen: torch.Generator,
                 timer: Timer) -> tuple[float, float]:
    """(index pass alone on a SMALL^2 S, a 16-float fill alone), ns, medians over
    SMALL_SHAPES: their difference is what a sparse plan's index launch adds to a call beyond
    the timer's own cost, which the per-element prices measured at --size^2 would otherwise
    spread over S (a 768-wide BERT layer's pass: 7.5 us on its 3 M elements, not 3.4)."""
    z = torch.zeros(16, device="cuda")
    fill = timer(z.zero_) * 1e6
    pts = []
    for micro in SMALL_SHAPES:
        unit = tuple(int(v) for v in micro.split("x"))
        mask = block_mask((SMALL, SMALL), unit, 0.5, gen)
        A = A0[:SMALL, :SMALL] * mask.to(A0.dtype)
        Bs = B[:SMALL, :SMALL].contiguous()
        call = timed_call(micro, A, Bs)
        call.build_index(None)
        pts.append(timer(lambda: call.build_index(None)) * 1e6)
    return float(np.median(pts)), fill


def products_profile(micros: list[str], shapes: dict, A0: torch.Tensor, B: torch.Tensor,
                     gen: torch.Generator, timer: Timer, index_fixed: float) -> dict:
    """The products kernel's fit: whole calls (index, products, finishing pass) at
    PRODUCTS_DENSITIES on the shapes it runs, less each shape's index price, fitted to
    ``ns_per_element * elements + out_ns_per_element * |C|`` as the planner prices it (its
    finishing pass writes C; it walks nothing of S beyond the index, so its walk is 0; the
    row-owner kernel's output price is not its own)."""
    rows, times = [], []
    for micro in micros:
        unit = tuple(int(v) for v in micro.split("x"))
        if unit[1] not in PRODUCTS_EXTENTS:
            continue
        for density in PRODUCTS_DENSITIES:
            mask = block_mask(tuple(A0.shape), unit, density, gen)
            A = A0 * mask.to(A0.dtype)
            cand = make_plan(EXPR, "A", mask=mask.cpu().numpy(), micro_tile=micro,
                             profile=UNIT_PROFILE).choice
            if not products_fit(cand.nonzero, A.shape[0]):
                continue
            call = rows_call(micro, A, B, Schedule(rows="products"))
            if call.L.spec.gemm.a_mode != "products":   # lowering kept the row-owner kernel
                continue
            t = timer(call.run) * 1e6  # ns
            rows.append((cand.cost, A.shape[0] * B.shape[1]))
            times.append(t - index_fixed - A.numel() * shapes[micro]["index_ns_per_element"])
            print(f"products         {micro:>7} density {density:.3f}: {t / 1e3:8.1f} us", flush=True)
    if not rows:
        raise SystemExit("measure_profile: no shape ran on the products kernel")
    per, out = nonnegative_fit(np.asarray(rows, float), np.asarray(times))
    return {"ns_per_element": per, "walk_ns_per_element": 0.0, "out_ns_per_element": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--write", default=str(resources.files("pitgen.profiles") / "measured.json"))
    ap.add_argument("--out", default=None, help="also copy the profile into this folder")
    args = ap.parse_args()
    n = args.size
    timer = Timer(args.repeats)  # median in ms
    gen = torch.Generator(device="cuda").manual_seed(0)
    B = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=gen)
    A0 = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=gen)
    small, fill = index_launch(A0, B, gen, timer)
    index_fixed = max(0.0, small - fill)
    print(f"index launch: {small / 1e3:.1f} us alone on {SMALL}^2, fill {fill / 1e3:.1f} us",
          flush=True)
    kinds, index_pts = {}, []
    for key, micros in KINDS.items():
        rows, times, dens, shapes, kind_index = [], [], [], {}, []
        for micro in micros:
            first, shape_index = len(rows), []
            unit = (1, 1) if micro == "dense" else tuple(int(v) for v in micro.split("x"))
            for split, densities in DEPTHS:
                k = n // split
                Bk = B[:k].contiguous()
                for density in densities if micro != "dense" or split == 1 else (1.0,):
                    mask = block_mask((n, k), unit, density, gen)
                    A = A0[:, :k] * mask.to(A0.dtype)
                    call = timed_call(micro, A, Bk)
                    # the planner's own work count: with unit per-element costs, cost == elements
                    cand = make_plan(EXPR, "A", mask=mask.cpu().numpy(), micro_tile=micro,
                                     profile=UNIT_PROFILE).choice
                    call.build_index(None)
                    t = timer(call.run) * 1e6  # ns: the whole call, as the planner prices it
                    rows.append((cand.dense_tiles, cand.cost, A.numel(), n * n))
                    times.append(t)
                    dens.append(density)
                    if key != "dense" and split == 1:
                        t_index = timer(lambda: call.build_index(None)) * 1e6
                        shape_index.append(max(0.0, t_index - small) / A.numel())
                    print(f"{key:16} {micro:>7} k {k:5} density {density:.2f}: "
                          f"{t / 1e3:8.1f} us, {cand.dense_tiles} dense tiles", flush=True)
            if key != "dense":
                # the kernels' share of each call: less the index's price as the planner adds it
                # (the index launches ahead of the kernel, which overlaps its tail: 2-5 us at
                # 4096^2 that index + kernel timed apart would count twice)
                index = float(np.median(shape_index))
                times[first:] = [t - index_fixed - r[2] * index
                                 for r, t in zip(rows[first:], times[first:])]
                # a spatial micro-tile's dense tiles are the row-owner kernel's steps, which its
                # elements do not count; elsewhere tiles and elements are proportional
                steps = key == "micro-spatial"
                fit = nonnegative_fit(np.asarray(rows[first:], float)[:, 0 if steps else 1:],
                                      np.asarray(times[first:]))
                fixed, per, walk, out = fit if steps else (0.0, *fit)
                shapes[micro] = {"fixed_ns": fixed, "ns_per_element": per,
                                 "walk_ns_per_element": walk, "out_ns_per_element": out,
                                 "index_ns_per_element": index}
                kind_index += shape_index
        X, y = np.asarray(rows, float), np.asarray(times)
        extra = {}
        if key == "dense":
            # every element computed (|S| is the elements; tiles are not fitted) on all-non-zero
            # S, and then the share of that time S's zeros save (cuBLAS 4096^3: 9% at 99%)
            zeros = 1.0 - np.asarray(dens)
            full = zeros == 0
            (per, out), fixed, walk = nonnegative_fit(X[full][:, [1, 3]], y[full]), 0.0, 0.0
            gain = X[:, 1] * per * zeros   # the element time the zeros could save
            saved = X[:, 1] * per + X[:, 3] * out - y
            z = float(np.dot(gain, saved) / np.dot(gain, gain)) if gain.any() else 0.0
            extra = {"zeros_discount": min(max(z, 0.0), 0.5)}
        else:
            fixed, per, walk, out = nonnegative_fit(X, y)
        kinds[key] = {"fixed_ns": fixed, "ns_per_element": per, "walk_ns_per_element": walk,
                      "out_ns_per_element": out, **extra}
        if key != "dense":
            kinds[key].update(index_ns_per_element=float(np.median(kind_index)), shapes=shapes)
            index_pts += kind_index
        if key == "micro-spatial":
            kinds[key]["products"] = products_profile(micros, shapes, A0, B, gen, timer,
                                                      index_fixed)
    profile = {
        "device": torch.cuda.get_device_name(), "measured": True, "dtype": "float16",
        "note": f"measured by scripts/measure_profile.py: A {n}x{n} and {n}x{n // 4}, B {n} "
                f"wide, fp16, "
                f"median of {args.repeats}, L2 flushed; torch {torch.__version__}, pitgen {pitgen.__version__}",
        "units": {"fixed_ns": "ns per dense tile (micro-spatial: per step of the row-owner "
                               "kernel, a row block's active rows of a k-tile, 64 at a time)",
                  "ns_per_element": "ns per element of S computed",
                  "walk_ns_per_element": "ns per element of S, paid whatever the density",
                  "out_ns_per_element": "ns per element of the product written (S's rows times "
                                        "B's width), paid whatever the density",
                  "zeros_discount": "dense only: the share of its element time the dense kernel "
                                    "saves on an all-zero S, in proportion to S's zeros",
                  "index_ns_per_element": "ns per element of S, paid once by every non-dense kind",
                  "index_fixed_ns": f"ns per call, paid once by every non-dense kind: the index "
                                    f"pass alone on a {SMALL}x{SMALL} S less a 16-float fill "
                                    f"alone (the timer's own cost)",
                  "width": "B's width the times were measured at; the planner scales the kernels' "
                           "terms (not the index's) by a product's own width over it",
                  "shapes": "a shape's own fit and index, which override its kind's",
                  "products": "micro-spatial only: the products kernel's fit (ns per element of S "
                              "computed, and per element of S whatever the density), for masks of at "
                              "most two micro-tiles per row of S on average (lower.PRODUCTS_SLOTS_PER_ROW)"},
        "kinds": kinds, "index_ns_per_element": float(np.median(index_pts)),
        "index_fixed_ns": index_fixed, "width": n,
    }
    text = json.dumps(profile, indent=2) + "\n"
    with open(args.write, "w") as f:
        f.write(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "measured.json"), "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
