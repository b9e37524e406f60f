"""GNN SpMM and SDDMM on SparseTIR's seven graphs (``pitgen bench graphs``): pitgen's tuned
format kernels against cuSPARSE (through torch), in one run on one GPU.

Graphs: pitgen.graphs' seeded power-law stand-ins with the node and edge counts of
cora, citeseer, pubmed, ppi, ogbn-arxiv, ogbn-proteins and reddit (generated in worker
processes while the GPU runs the smaller graphs, and kept in --graphs for the next run).
Cases: feature sizes 32-512 (reddit: 32-128, to fit the time), float32 and float16.
Systems: SpMM against ``torch.sparse.mm`` on a sparse CSR tensor (cuSPARSE SpMM), SDDMM against
``torch.sparse.sampled_addmm`` (cuSPARSE SDDMM; a dtype it refuses, float16 in torch 2.11, is
not run for SDDMM, and the notes say so); pitgen's untuned ``format="auto"`` (the cost model of
:func:`pitgen.graph.model.plan`, with its planning time: row statistics on the GPU, one host
sync, the model), pitgen's choice from :func:`pitgen.graph.tune.tune` with a small per-case
budget (a fresh tune cache, so every case really searches) and pitgen's default CSR kernel.
Each pitgen result is checked against the peer's.

Before timing, the kernels the tuner's first phases use are compiled in parallel threads into
pitgen's cubin cache (nvcc is not counted inside the per-case budgets). The floor column is the
bytes every kernel must move (CSR arrays, each dense operand read once, the output written
once) at the measured device copy rate. Writes graphs.md and graphs.json.
"""
from __future__ import annotations

import gc
import itertools
import os
import sys
import tempfile
import time
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pitgen.graphs import GNN_GRAPHS, GRAPHS, make_graph

from .report import fmt, geomean, md_table, rel_err, write_json

if TYPE_CHECKING:
    from .suite import Run
    from .timing import Timer

FEATS = (32, 64, 128, 256, 512)
#: reddit (114M edges) at 256 and 512 features would take most of the time budget alone
FEATS_OF = {"reddit": (32, 64, 128)}
DTYPES = ("float32", "float16")
OPS = ("spmm", "sddmm")
QUICK_GRAPHS = ("cora", "pubmed", "ogbn-arxiv")
QUICK_FEATS = (32, 128)
TOL = {"float32": 1e-4, "float16": 1e-2}
TARGETS = {"spmm": 1.5, "sddmm": 2.0}


# -- graphs (CPU, in worker processes) ---------------------------------------------------------

def graph_file(name: str, folder: str) -> str:
    """Generate ``name`` into ``folder`` unless it is there; returns the .npz path. Runs in a
    worker process (NumPy only)."""
    import numpy as np

    path = Path(folder) / f"{name}-seed0.npz"
    if not path.exists():
        csr = make_graph(name)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".npz")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, indptr=csr.indptr, indices=csr.indices, shape=np.array(csr.shape))
        os.replace(tmp, path)
    return str(path)


def cases(quick: bool) -> list[tuple[str, int]]:
    """(graph, feature size) in run order: graphs smallest first."""
    names = QUICK_GRAPHS if quick else tuple(sorted(GNN_GRAPHS, key=lambda g: GRAPHS[g].edges))
    return [(g, f) for g in names for f in (QUICK_FEATS if quick else FEATS_OF.get(g, FEATS))]


def case_budget(nnz: int, given: float | None) -> float:
    """Tuning seconds of one case: --tune-budget, else more for graphs of 1M edges and up."""
    return given if given is not None else (0.25 if nnz < 1_000_000 else 0.75)


def floor_bytes(op: str, rows: int, cols: int, nnz: int, feat: int, elem: int) -> int:
    """Bytes every kernel must move: the CSR arrays (indptr, int32 indices, values for SpMM),
    each dense operand read once and the output written once."""
    csr = 4 * (rows + 1) + 4 * nnz
    if op == "spmm":
        return csr + elem * nnz + elem * cols * feat + elem * rows * feat
    return csr + elem * (rows + cols) * feat + elem * nnz


# -- GPU -------------------------------------------------------------------------------------

def run_case(timer: Timer, copy_rate: float, name: str, a: Any, op: str, feat: int,
             dtype: str, budget: float) -> dict:
    """One case of one graph: pitgen's model choice (untuned auto), tuned pitgen, default CSR
    and the peer, each checked and timed."""
    import torch

    from pitgen.graph import kernels as graph_ops
    from pitgen.graph.device import DeviceCSR, to_format
    from pitgen.graph.model import plan
    from pitgen.graph.tune import tune

    rows, cols = a.shape
    tdt = getattr(torch, dtype)
    elem = torch.finfo(tdt).bits // 8
    g = torch.Generator(device="cuda").manual_seed(feat)
    row = {"graph": name, "nodes": rows, "nnz": a.nnz, "op": op, "dtype": dtype,
           "feat": feat, "flop": 2 * a.nnz * feat}
    row["floor_ms"] = floor_bytes(op, rows, cols, a.nnz, feat, elem) / copy_rate
    # before the search, whose result the tune cache would then answer with
    auto = plan(a, op, feat, dtype)
    row.update(auto_choice=auto.fmt, auto_params=auto.params, auto_schedule=auto.schedule,
               auto_source=auto.source, plan_ms=auto.plan_ms)
    res = tune(a, op, feat, dtype, budget_s=budget)
    row.update(choice=res.fmt, params=res.params, schedule=res.schedule,
               tune_s=res.search_s, trials=res.trials)
    row["convert_ms"] = next((t.convert_ms for t in res.log if t.status == "ok" and
                              t.fmt == res.fmt and t.params == res.params
                              and t.convert_ms is not None), None)
    # converted on a view of a: a's own conversion cache would keep every case's layout
    m = to_format(DeviceCSR(a.shape, a.indptr, a.indices, a.values), res.fmt, **res.params)
    ma = to_format(DeviceCSR(a.shape, a.indptr, a.indices, a.values), auto.fmt, **auto.params)
    a_t = a.to_torch()
    t = timer
    if op == "spmm":
        x = torch.randn(cols, feat, device="cuda", generator=g).to(tdt)
        y = torch.full((rows, feat), float("nan"), dtype=tdt, device="cuda")
        graph_ops.spmm(m, x, schedule=res.schedule, out=y)
        ref = torch.sparse.mm(a_t, x)
        row["rel_err"] = rel_err(y, ref)
        row["csr_rel_err"] = rel_err(graph_ops.spmm(a, x), ref)
        row["auto_rel_err"] = rel_err(graph_ops.spmm(ma, x, schedule=auto.schedule), ref)
        model = t.both(lambda: graph_ops.spmm(ma, x, schedule=auto.schedule, out=y))
        mine = t.both(lambda: graph_ops.spmm(m, x, schedule=res.schedule, out=y))
        row["csr_ms"] = t(lambda: graph_ops.spmm(a, x, out=y))
        peer = t.both(lambda: torch.sparse.mm(a_t, x))
    else:
        u = torch.randn(rows, feat, device="cuda", generator=g).to(tdt)
        v = torch.randn(cols, feat, device="cuda", generator=g).to(tdt)
        vt = v.t().contiguous()
        e = graph_ops.sddmm(m, u, v, schedule=res.schedule)
        ref = torch.sparse.sampled_addmm(a_t, u, vt, beta=0.0, alpha=1.0).values()
        row["rel_err"] = rel_err(e, ref)
        peer = t.both(lambda: torch.sparse.sampled_addmm(a_t, u, vt, beta=0.0, alpha=1.0))
        row["csr_rel_err"] = rel_err(graph_ops.sddmm(a, u, v), ref)
        row["auto_rel_err"] = rel_err(graph_ops.sddmm(ma, u, v, schedule=auto.schedule), ref)
        model = t.both(lambda: graph_ops.sddmm(ma, u, v, schedule=auto.schedule))
        mine = t.both(lambda: graph_ops.sddmm(m, u, v, schedule=res.schedule))
        row["csr_ms"] = t(lambda: graph_ops.sddmm(a, u, v))
    row["pitgen_ms"], row["pitgen_wall_ms"] = mine.gpu_ms, mine.wall_ms
    row["auto_ms"], row["auto_wall_ms"] = model.gpu_ms, model.wall_ms
    row["peer_ms"], row["peer_wall_ms"] = peer.gpu_ms, peer.wall_ms
    row["ok"] = all(row[k] <= TOL[dtype] for k in ("rel_err", "csr_rel_err", "auto_rel_err"))
    row["auto_speedup"] = row["peer_ms"] / row["auto_ms"]
    row["speedup"] = row["peer_ms"] / row["pitgen_ms"]
    row["wall_speedup"] = row["peer_wall_ms"] / row["pitgen_wall_ms"]
    row["csr_speedup"] = row["peer_ms"] / row["csr_ms"]
    row["tflops"] = row["flop"] / row["pitgen_ms"] / 1e9
    return row


def sddmm_peer_refuses(dtype: str) -> str | None:
    """Why torch.sparse.sampled_addmm refuses ``dtype`` (torch 2.11: no float16), or None."""
    import torch

    tdt = getattr(torch, dtype)
    a = torch.eye(4, device="cuda", dtype=tdt).to_sparse_csr()
    x = torch.ones(4, 4, device="cuda", dtype=tdt)
    try:
        torch.sparse.sampled_addmm(a, x, x, beta=0.0)
    except RuntimeError as e:
        return str(e).splitlines()[0][:100]
    return None


def warm_sources() -> list[tuple[str, dict]]:
    """(template, context) of the kernels the default and parameter phases of every tuning
    use: each format's default schedule per dtype and F, BSR at every block size, hyb at every
    (c, k) with and without cut rows (the contexts graph_ops builds; hyb's depends on the
    layout only through the bucket widths and which buckets need atomics)."""
    from types import SimpleNamespace

    from pitgen.graph import kernels as graph_ops
    from pitgen.graph.device import hyb_atomic
    from pitgen.graph.formats import BSR_BLOCKS
    from pitgen.graph.tune import HYB_C, HYB_K

    out: dict[str, tuple[str, dict]] = {}
    for dtype in DTYPES:
        for feat in FEATS:
            for form in ("csr", "ell", "bsr", "hyb"):
                layouts = [SimpleNamespace(fmt=form, dtype=dtype, params={}, info={})]
                if form == "bsr":
                    layouts = [SimpleNamespace(fmt=form, dtype=dtype, params={"block": b},
                                               info={}) for b in BSR_BLOCKS]
                if form == "hyb":
                    layouts = []
                    for c, k, cut in itertools.product(HYB_C, HYB_K, (False, True)):
                        widths = [1 << e for e in range(k + 1)] * c
                        layouts.append(SimpleNamespace(
                            fmt=form, dtype=dtype, params={"c": c, "k": k},
                            info={"widths": widths,
                                  "atomic": [hyb_atomic(c, k, w, cut) for w in widths]}))
                for m in layouts:
                    sched = graph_ops.default_schedule("spmm", form, feat, dtype)
                    ctx = graph_ops.spmm_context(m, sched, sched["vec"], feat)
                    out[repr(("spmm", sorted(ctx.items())))] = ("spmm.cu.j2", ctx)
                    sched = graph_ops.default_schedule("sddmm", form, feat, dtype)
                    ctx = {"dtype": dtype, "fmt": form, "vec": sched["vec"],
                           "threads": sched["threads"], "group": sched["group"]}
                    if form == "bsr":
                        ctx["block"] = m.params["block"]
                    out[repr(("sddmm", sorted(ctx.items())))] = ("graph_sddmm.cu.j2", ctx)
    return list(out.values())


def warm_compile_cache() -> str:
    """Compile :func:`warm_sources` with nvcc in parallel threads into pitgen's cubin cache, so
    that the per-case tuning budgets time kernels rather than first-use compiles. A failure
    only costs time later (the tuner compiles what it needs); the returned line says so."""
    from pitgen.errors import PitgenError
    from pitgen.render import render_template
    from pitgen.runtime import precompile

    t = time.monotonic()
    try:
        jobs = warm_sources()
        precompile(render_template(name, **ctx) for name, ctx in jobs)
    except (PitgenError, KeyError, TypeError, AttributeError) as e:
        return f"compile-cache warm-up failed ({type(e).__name__}: {e}); kernels compiled on use"
    return (f"{len(jobs)} default kernels compiled in parallel before timing "
            f"({time.monotonic() - t:.0f} s, cubin cache), not inside the tuning budgets")


def device_csr(path: str, dtype: str, seed: int = 0) -> Any:
    """The graph on the GPU with random values in [0.5, 1.5) (never zeros)."""
    import torch

    from pitgen.graph.device import DeviceCSR
    from pitgen.graph.formats import load_graph

    csr = load_graph(path)
    ip = torch.from_numpy(csr.indptr.astype("int32")).cuda()
    ix = torch.from_numpy(csr.indices.astype("int32")).cuda()
    g = torch.Generator(device="cuda").manual_seed(seed)
    vals = (torch.rand(csr.nnz, device="cuda", generator=g) + 0.5).to(getattr(torch, dtype))
    return DeviceCSR(csr.shape, ip, ix, vals)


# -- report ----------------------------------------------------------------------------------

def _choice(r: dict, prefix: str = "") -> str:
    """A row's tuned choice (or, with prefix "auto_", the model's) in a few characters."""
    fmt_name = r[f"{prefix}choice"]
    p = ",".join(f"{k}={v}" for k, v in r[f"{prefix}params"].items())
    s = r[f"{prefix}schedule"]
    g = s.get("group", s.get("groups"))
    if isinstance(g, list):
        g = "/".join(map(str, sorted(set(g))))
    u = f" u{s['unroll']}" if fmt_name == "csr" and "unroll" in s else ""
    return f"{fmt_name}({p}) g{g} v{s.get('vec')} t{s.get('threads')}{u}"


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for op in OPS:
        for dt in DTYPES:
            rs = [r for r in rows if r["op"] == op and r["dtype"] == dt]
            if not rs:
                continue
            gm = geomean([r["speedup"] for r in rs])
            out.append({"op": op, "dtype": dt, "cases": len(rs), "geomean_speedup": gm,
                        "geomean_csr_speedup": geomean([r["csr_speedup"] for r in rs]),
                        "geomean_wall_speedup": geomean([r["wall_speedup"] for r in rs]),
                        "geomean_vs_default_csr": geomean([r["csr_ms"] / r["pitgen_ms"]
                                                           for r in rs]),
                        "geomean_auto_speedup": geomean([r["auto_speedup"] for r in rs]),
                        "geomean_auto_vs_tuned": geomean([r["pitgen_ms"] / r["auto_ms"]
                                                          for r in rs]),
                        "max_plan_ms": max(r["plan_ms"] for r in rs),
                        "target": TARGETS[op],
                        "met": None if gm is None else gm >= TARGETS[op],
                        "all_correct": all(r["ok"] for r in rs)})
    return out


def write(out: Path, rows: list[dict], meta: dict, skipped: list[str], notes: list[str]) -> None:
    """graphs.json (everything) and graphs.md (geometric means first, then every case)."""
    summ = summary(rows)
    write_json(out / "graphs.json", {"meta": meta, "summary": summ, "rows": rows,
                                     "skipped": skipped, "notes": notes})
    lines = ["# GNN SpMM / SDDMM: pitgen's model choice (untuned auto) and tuned formats vs "
             "cuSPARSE",
             "", f"Device: **{meta['device']}** (torch {meta['torch']}, CUDA {meta['cuda']}); "
             f"{meta['date']}; device copy rate {meta['copy_gb_s']:.0f} GB/s; run "
             f"{meta['elapsed_s']:.0f} s. Times: median of {meta['repeats']} runs (CUDA events, "
             "L2 flushed). Speed-up = peer ms / pitgen ms. auto (model) = untuned "
             "`format=\"auto\"`: `pitgen.graph.model.plan`'s choice (row statistics on the GPU, "
             "one host sync, then the cost model; plan ms = that planning, no conversion, no "
             "compile); pitgen tuned = `pitgen.graph.tune.tune` "
             "with the per-case budget (fresh cache); default CSR = pitgen's CSR kernel with its "
             "default schedule. Floor = compulsory bytes at the copy rate. Wall: eager wall time "
             "per call, back to back (host launch cost included).", ""]
    lines += ["## Geometric-mean speed-ups", ""] + md_table(
        ["op", "dtype", "cases", "auto (model) vs peer", "auto (model) / tuned",
         "max plan ms", "tuned vs peer", "tuned vs peer, eager wall",
         "default CSR vs peer", "tuned vs default CSR", "target", "met",
         "all results match the peer"],
        [[s["op"], s["dtype"], s["cases"], f"{fmt(s['geomean_auto_speedup'], 2)}x",
          f"{fmt(s['geomean_auto_vs_tuned'], 2)}x", fmt(s["max_plan_ms"], 1),
          f"{fmt(s['geomean_speedup'], 2)}x",
          f"{fmt(s.get('geomean_wall_speedup'), 2)}x",
          f"{fmt(s['geomean_csr_speedup'], 2)}x", f"{fmt(s['geomean_vs_default_csr'], 2)}x",
          f">= {s['target']}x", "-" if s["met"] is None else ("**met**" if s["met"] else
                                                              "**missed**"),
          "yes" if s["all_correct"] else "NO"] for s in summ])
    lines += ["", "## Cases", ""] + md_table(
        ["graph", "nnz", "op", "dtype", "F", "floor ms", "peer ms (wall)", "default CSR ms",
         "auto (model) ms", "auto vs peer", "auto choice", "plan ms",
         "pitgen ms (wall)", "vs peer", "wall vs peer", "choice", "convert ms",
         "tune s (trials)", "rel err"],
        [[r["graph"], r["nnz"], r["op"], r["dtype"], r["feat"], fmt(r["floor_ms"], 4),
          f"{fmt(r['peer_ms'], 4)} ({fmt(r.get('peer_wall_ms'), 4)})", fmt(r["csr_ms"], 4),
          fmt(r["auto_ms"], 4), f"{fmt(r['auto_speedup'], 2)}x", _choice(r, "auto_"),
          fmt(r["plan_ms"], 1),
          f"{fmt(r['pitgen_ms'], 4)} ({fmt(r.get('pitgen_wall_ms'), 4)})",
          f"{fmt(r['speedup'], 2)}x", f"{fmt(r.get('wall_speedup'), 2)}x", _choice(r),
          fmt(r["convert_ms"], 2),
          f"{r['tune_s']:.1f} ({r['trials']})",
          f"{r['rel_err']:.1e}" + ("" if r["ok"] else " **MISMATCH**")] for r in rows])
    if skipped or notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
        if skipped:
            lines.append(f"- skipped (time budget --budget): {', '.join(skipped)}")
    (out / "graphs.md").write_text("\n".join(lines) + "\n")


def run(r: Run) -> int:
    """Graphs smallest first, generated in worker processes while the GPU runs; files
    rewritten after every graph."""
    import torch

    from pitgen import cache

    t0 = time.monotonic()
    max_s = r.budget(220.0)
    folder = Path(r.args.graphs) if r.args.graphs else cache.directory("graphs")
    folder.mkdir(parents=True, exist_ok=True)
    old_cache = os.environ.get("PITGEN_TUNE_CACHE")
    os.environ["PITGEN_TUNE_CACHE"] = tempfile.mkdtemp(prefix="pitgen-tune-")  # every case searches
    todo = cases(r.args.quick)
    names = list(dict.fromkeys(g for g, _ in todo))
    pool = ProcessPoolExecutor(max_workers=min(len(names), max(1, (os.cpu_count() or 2) // 2)),
                               mp_context=get_context("spawn"))
    futures: dict[str, Future] = {g: pool.submit(graph_file, g, str(folder))  # longest first
                                  for g in sorted(names, key=lambda g: -GRAPHS[g].edges)}
    warm = warm_compile_cache()
    print(warm, file=sys.stderr, flush=True)
    rows: list[dict] = []
    skipped: list[str] = []
    notes = [] if r.args.quick else [
        f"reddit runs F = {', '.join(map(str, FEATS_OF['reddit']))} only (time budget)"]
    notes.append(warm)
    refused = {dt: sddmm_peer_refuses(dt) for dt in DTYPES}
    notes += [f"torch.sparse.sampled_addmm refuses {dt} ({why}): SDDMM runs {dt} not at all"
              for dt, why in refused.items() if why]
    meta = {**r.meta, "quick": r.args.quick}
    try:
        for g in names:
            path = futures[g].result()
            for dtype in DTYPES:
                a = device_csr(path, dtype)
                for op, (gg, feat) in itertools.product(OPS, todo):
                    what = f"{g} {op} {dtype} F={feat}"
                    if gg != g or (op == "sddmm" and refused[dtype]):
                        continue
                    if time.monotonic() - t0 > max_s:
                        skipped.append(what)
                        continue
                    x = run_case(r.timer, r.ceilings.copy_bytes_per_ms, g, a, op, feat, dtype,
                                 case_budget(a.nnz, r.args.tune_budget))
                    rows.append(x)
                    gc.collect()  # this case's layouts (reference cycles with their source)
                    print(f"{what}: auto {x['auto_ms']:.4f} ms ({_choice(x, 'auto_')}, planned "
                          f"in {x['plan_ms']:.1f} ms), tuned {x['pitgen_ms']:.4f} ms "
                          f"({_choice(x)}), peer "
                          f"{x['peer_ms']:.4f} ms, csr {x['csr_ms']:.4f} ms, err "
                          f"{x['rel_err']:.1e} | {time.monotonic() - t0:.0f}s",
                          file=sys.stderr, flush=True)
                del a
                torch.cuda.empty_cache()
            meta["elapsed_s"] = time.monotonic() - t0
            write(r.out, rows, meta, skipped, notes)
    finally:
        pool.shutdown(cancel_futures=True)
        if old_cache is None:
            os.environ.pop("PITGEN_TUNE_CACHE", None)
        else:
            os.environ["PITGEN_TUNE_CACHE"] = old_cache
    meta["elapsed_s"] = time.monotonic() - t0
    write(r.out, rows, meta, skipped, notes)
    print((r.out / "graphs.md").read_text().split("## Cases")[0])
    return 0 if all(x["ok"] for x in rows) else 1
