"""Graphs that change every call (``pitgen bench dynamic``): conversion at kernel speed.

Two tables on SparseTIR's seven GNN graphs (pitgen.graphs' stand-ins), F = FEAT:

* **Conversions**: a GPU CSR converted to hyb (the parameters ``format="auto"`` would use for
  hyb), ELL and BSR, each call on a fresh DeviceCSR (no conversion cache), against the SpMM
  that the hyb layout feeds. Target: hyb conversion <= HYB_TARGET x that SpMM.
* **A new graph every call**: each call gets a new edge list (DropEdge: every edge kept with
  probability KEEP, a pool of POOL lists rotated so no call sees the previous one's graph) and
  multiplies it by X with the SpMM kernel of ``pitgen.compile(..., format="auto",
  dynamic=True)``. pitgen: the edge list as a ``DeviceCOO``, which "auto" multiplies as it
  comes (one launch of atomic adds) while ``pitgen.graph.model.coo_pays``, else converts as
  below; "pitgen CSR": ``DeviceCSR.from_coo(..., sort=False)`` (rows grouped by a counting
  pass and a scatter, each row's columns in any order: SpMM's reduction axis is permutation
  invariant; "pitgen sorted": ``sort=True``, a radix sort, deterministic sums), then the
  format chosen once for the shape (from the first graph's row statistics), each new graph
  converted without a host sync (hyb sized by bounds) and multiplied. Peers, each its own CSR
  build then ``torch.sparse.mm`` (cuSPARSE): ``coo.to_sparse_csr()`` (torch's coalesce), and a sort of
  (row, col) keys with ``searchsorted`` into ``torch.sparse_csr_tensor``; the faster is the
  reference. Target: >= DYNAMIC_TARGET x the faster peer, geomean (of ``pitgen``; the sorted
  variant's speed-up is reported beside it).

Times: GPU (CUDA events, median, L2 flushed) and eager wall per call (``Timer.both``); calls
that synchronise leave the GPU idle while the host works, so their GPU time includes it.
Results are checked against the peer's (relative norm). Writes dynamic.md and dynamic.json.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .report import fmt, fmt_x, geomean, md_table, rel_err, speedup_summary, speedup_table, \
    write_json

if TYPE_CHECKING:
    from .suite import Run

DTYPES = ("float32", "float16")
FEAT = 64
KEEP = 0.8
POOL = 4
QUICK_GRAPHS = ("cora", "pubmed", "ogbn-arxiv")
HYB_TARGET = 2.0
DYNAMIC_TARGET = 1.3
TOL = {"float32": 1e-5, "float16": 1e-2}
SPMM = "Y[i,f] += A[i,j] * X[j,f]"
#: torch's CSR builds, each followed by torch.sparse.mm (peers())
PEERS = ("torch coo.to_sparse_csr", "torch sort + csr")
#: ELL / BSR layouts above this many bytes are not timed (power-law rows pad them hugely)
MAX_LAYOUT_BYTES = 1 << 30


def _fresh(d: Any) -> Any:
    """The same matrix as a new DeviceCSR: its conversions are not cached yet."""
    from pitgen.graph.device import DeviceCSR
    return DeviceCSR(d.shape, d.indptr, d.indices, d.values)


def conversions(r: Run, name: str, d: Any, dtype: str) -> dict:
    """hyb / ELL / BSR conversion times of ``d`` (end to end, and for hyb its kernels alone)
    and the SpMM its hyb layout feeds."""
    import torch

    from pitgen.errors import ShapeError
    from pitgen.graph.device import hyb_counts, hyb_layout, to_format
    from pitgen.graph.kernels import default_schedule, spmm
    from pitgen.graph.model import hyb_params
    from pitgen.graph.tune import GraphStats

    stats = GraphStats.from_dict(d.row_stats())
    hyb = hyb_params(stats, "spmm", FEAT, dtype)
    x = torch.randn(d.shape[1], FEAT, device="cuda", dtype=getattr(torch, dtype))
    row: dict[str, Any] = {"graph": name, "dtype": dtype, "rows": d.shape[0], "nnz": d.nnz,
                           "hyb": hyb, "convert": {}}
    rows, cols = d.shape
    for fmt_name, params in (("hyb", hyb), ("ell", {}), ("bsr", {"block": 16})):
        # bytes before converting: ELL's padded slots (cols, values, perm), BSR's block flags
        need = {"ell": rows * stats.max * 12,
                "bsr": -(-rows // 16) * -(-cols // 16) * 4}.get(fmt_name, 0)
        try:
            if need > MAX_LAYOUT_BYTES:
                raise ShapeError(f"{need / 2**30:.1f} GiB")
            slots = to_format(_fresh(d), fmt_name, **params).info["slots"]
            if fmt_name != "hyb" and slots * 12 > MAX_LAYOUT_BYTES:   # cols, values, perm
                raise ShapeError(f"{slots / max(d.nnz, 1):.0f}x padding")
        except (ShapeError, torch.OutOfMemoryError) as exc:   # too big for this device
            if fmt_name == "hyb":
                raise
            row["convert"][fmt_name] = {"note": f"not run: {str(exc).splitlines()[0][:60]}"}
            torch.cuda.empty_cache()
            continue
        t = r.timer.both(lambda: to_format(_fresh(d), fmt_name, **params))
        row["convert"][fmt_name] = {"gpu_ms": t.gpu_ms, "wall_ms": t.wall_ms}
    t = r.timer.both(lambda: to_format(_fresh(d), "hyb", sync=False, **hyb))
    row["convert"]["hyb no sync"] = {"gpu_ms": t.gpu_ms, "wall_ms": t.wall_ms}
    scan = hyb_counts(d, **hyb)
    totals = scan[:, -1].tolist()
    row["hyb_kernel_ms"] = r.timer(lambda: hyb_counts(d, **hyb)) + \
        r.timer(lambda: hyb_layout(d, hyb["c"], hyb["k"], scan, totals))
    m = to_format(d, "hyb", **hyb)
    sched = default_schedule("spmm", "hyb", FEAT, dtype)
    t = r.timer.both(lambda: spmm(m, x, schedule=sched))
    row["spmm"] = {"gpu_ms": t.gpu_ms, "wall_ms": t.wall_ms}
    row["hyb_ratio"] = row["convert"]["hyb"]["gpu_ms"] / t.gpu_ms
    row["hyb_nosync_ratio"] = row["convert"]["hyb no sync"]["gpu_ms"] / t.gpu_ms
    row["hyb_kernel_ratio"] = row["hyb_kernel_ms"] / t.gpu_ms
    row["hyb_wall_ratio"] = row["convert"]["hyb"]["wall_ms"] / t.wall_ms
    return row


def peers() -> dict[str, Any]:
    """torch's ways to build a CSR from an edge list and multiply, by name."""
    import torch

    def coalesce(shape, rows, cols, vals, x):
        a = torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, shape).to_sparse_csr()
        return torch.sparse.mm(a, x)

    def sort(shape, rows, cols, vals, x):
        key, order = torch.sort(rows * shape[1] + cols)
        starts = torch.arange(shape[0] + 1, device=rows.device) * shape[1]
        indptr = torch.searchsorted(key, starts)
        a = torch.sparse_csr_tensor(indptr, cols[order], vals[order], shape)
        return torch.sparse.mm(a, x)

    return dict(zip(PEERS, (coalesce, sort)))


def dynamic(r: Run, name: str, d: Any, dtype: str, seed: int = 0) -> dict:
    """A new DropEdge graph every call: pitgen's build + auto SpMM vs torch's build + mm."""
    import torch

    import pitgen
    from pitgen.graph.device import DeviceCOO, DeviceCSR
    from pitgen.graph.model import coo_pays

    tdt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows_all = d.row_ids().to(torch.int64)
    cols_all = d.indices.to(torch.int64)
    pool = []
    for _ in range(POOL):
        keep = torch.rand(d.nnz, device="cuda", generator=gen) < KEEP
        rows, cols = rows_all[keep], cols_all[keep]
        vals = torch.randn(rows.shape[0], device="cuda", generator=gen).to(tdt)
        pool.append((rows, cols, vals))
    x = torch.randn(d.shape[1], FEAT, device="cuda", generator=gen).to(tdt)
    kernel = pitgen.compile(SPMM, sparse="A", format="auto", dtype=dtype, dynamic=True)

    def edges(rows, cols, vals):
        return kernel(DeviceCOO(d.shape, rows, cols, vals), x)

    def via_csr(sort: bool):
        def call(rows, cols, vals):
            return kernel(DeviceCSR.from_coo(d.shape, rows, cols, vals, check=False, sort=sort),
                          x)
        return call

    row: dict[str, Any] = {"graph": name, "dtype": dtype, "rows": d.shape[0],
                           "edges": int(pool[0][0].shape[0]), "systems": {}}
    ref = None
    outs: dict[str, Any] = {}
    systems = {"pitgen": edges, "pitgen CSR": via_csr(False), "pitgen sorted": via_csr(True),
               **{p: (lambda f: lambda *a: f(d.shape, *a, x))(f) for p, f in peers().items()}}
    for sys_name, fn in systems.items():
        try:
            got = fn(*pool[0])
        except RuntimeError as exc:   # a torch path refuses this dtype
            if sys_name.startswith("pitgen"):
                raise
            row["systems"][sys_name] = {"note": f"not run: {str(exc).splitlines()[0][:80]}"}
            continue
        t = r.timer.both(fn, inputs=pool, calls=2 * POOL)
        res = {"gpu_ms": t.gpu_ms, "wall_ms": t.wall_ms}
        if sys_name.startswith("pitgen"):
            outs[sys_name] = got
            res["choice"] = ("coo", {}, {}) if sys_name == "pitgen" and coo_pays(
                row["edges"], FEAT) else kernel.prepare("A", DeviceCSR.from_coo(
                    d.shape, *pool[0], check=False, sort=sys_name == "pitgen sorted"), FEAT)[1]
        elif ref is None:
            ref = got
        row["systems"][sys_name] = res
    errs = [rel_err(o.float(), ref.float()) if ref is not None else float("nan")
            for o in outs.values()]
    ok_peers = [s for n, s in row["systems"].items() if not n.startswith("pitgen")
                and "gpu_ms" in s]
    best = min((s["gpu_ms"] for s in ok_peers), default=None)
    best_wall = min((s["wall_ms"] for s in ok_peers), default=None)
    ours, ours_csr, ours_sorted = (row["systems"][n] for n in ("pitgen", "pitgen CSR",
                                                                "pitgen sorted"))
    row.update(err=max(errs), ok=all(e <= TOL[dtype] for e in errs), best_peer_ms=best,
               speedup=best / ours["gpu_ms"] if best else None,
               wall_speedup=best_wall / ours["wall_ms"] if best_wall else None,
               csr_speedup=best / ours_csr["gpu_ms"] if best else None,
               csr_wall_speedup=best_wall / ours_csr["wall_ms"] if best_wall else None,
               sorted_speedup=best / ours_sorted["gpu_ms"] if best else None)
    return row


def write(out: Path, conv: list[dict], dyn: list[dict], meta: dict) -> None:
    summ = speedup_summary(dyn, DTYPES, DYNAMIC_TARGET)
    hyb_gm = {dt: geomean([c["hyb_ratio"] for c in conv if c["dtype"] == dt]) for dt in DTYPES}
    kern_gm = {dt: geomean([c["hyb_kernel_ratio"] for c in conv if c["dtype"] == dt])
               for dt in DTYPES}
    nosync_gm = {dt: geomean([c["hyb_nosync_ratio"] for c in conv if c["dtype"] == dt])
                 for dt in DTYPES}
    write_json(out / "dynamic.json", {"meta": meta, "summary": summ, "hyb_ratio_geomean": hyb_gm,
                                      "hyb_kernel_ratio_geomean": kern_gm,
                                      "hyb_nosync_ratio_geomean": nosync_gm, "conversions": conv,
                                      "dynamic": dyn})
    peer_names = PEERS
    lines = ["# Graphs that change every call: conversion and SpMM", "",
             f"Device: **{meta['device']}** (torch {meta['torch']}, CUDA {meta['cuda']}); "
             f"{meta['date']}. F = {FEAT}. GPU ms: median of {meta['repeats']} calls (CUDA "
             "events, L2 flushed; a call that synchronises with the host leaves the GPU idle "
             "meanwhile, and that idle time counts); wall ms: eager, per call. "
             "`pitgen bench dynamic` (pitgen/bench/dynamic.py says what each system does).", "",
             "## A new graph every call (DropEdge: each edge kept with probability "
             f"{KEEP}, {POOL} graphs rotated)", ""]
    lines += speedup_table(summ)
    lines += [""] + md_table(
        ["graph", "dtype", "edges", "pitgen ms (wall)", "pitgen CSR ms (wall)",
         "pitgen sorted ms (wall)", *[f"{p} ms (wall)" for p in peer_names], "speed-up",
         "wall speed-up", "CSR speed-up (wall)", "sorted speed-up", "pitgen's choice",
         "rel err"],
        [[x["graph"], x["dtype"], x["edges"], _cell(x["systems"]["pitgen"]),
          _cell(x["systems"]["pitgen CSR"]), _cell(x["systems"]["pitgen sorted"]),
          *[_cell(x["systems"].get(p, {"note": "-"})) for p in peer_names],
          fmt_x(x["speedup"]), fmt_x(x["wall_speedup"]),
          f"{fmt_x(x['csr_speedup'])} ({fmt_x(x['csr_wall_speedup'])})",
          fmt_x(x["sorted_speedup"]), _choice(x["systems"]["pitgen"].get("choice")),
          f"{x['err']:.1e}"] for x in dyn])
    lines += ["", f"## Conversion from a GPU CSR vs the SpMM it feeds (target: hyb <= "
              f"{HYB_TARGET}x)", "",
              "hyb ms: the whole `to_format` call (two launches, the one host sync after "
              "the first that sizes the layout, allocation); hyb no sync: `to_format(..., "
              "sync=False)`, sized by bounds (what `dynamic=True` runs); hyb kernels ms: the "
              "device work alone (the two launches timed apart, host launches "
              "hidden).", "",
              "; ".join(f"{dt}: hyb / SpMM geomean {fmt_x(hyb_gm[dt])}, no sync "
                        f"{fmt_x(nosync_gm[dt])}, kernels only {fmt_x(kern_gm[dt])}"
                        for dt in DTYPES), ""]
    lines += md_table(
        ["graph", "dtype", "nnz", "hyb params", "hyb ms (wall)", "hyb no sync ms (wall)",
         "hyb kernels ms", "ELL ms (wall)", "BSR16 ms (wall)", "SpMM on hyb ms (wall)",
         "hyb / SpMM", "no sync / SpMM", "kernels / SpMM", "wall hyb / SpMM"],
        [[c["graph"], c["dtype"], c["nnz"], c["hyb"], _cell(c["convert"]["hyb"]),
          _cell(c["convert"]["hyb no sync"]), fmt(c["hyb_kernel_ms"], 4),
          _cell(c["convert"]["ell"]), _cell(c["convert"]["bsr"]), _cell(c["spmm"]),
          fmt_x(c["hyb_ratio"]), fmt_x(c["hyb_nosync_ratio"]), fmt_x(c["hyb_kernel_ratio"]),
          fmt_x(c["hyb_wall_ratio"])] for c in conv])
    (out / "dynamic.md").write_text("\n".join(lines) + "\n")


def _cell(s: dict) -> str:
    return s["note"] if "gpu_ms" not in s else f"{fmt(s['gpu_ms'], 4)} ({fmt(s['wall_ms'], 4)})"


def _choice(c: Any) -> str:
    return "-" if not c else f"{c[0]} {c[1]}"


def run(r: Run) -> int:
    """The seven graphs (quick: cora, pubmed, ogbn-arxiv), smallest first, generated in worker
    processes into the folder ``pitgen bench graphs`` uses; files rewritten after each graph."""
    import torch

    from pitgen.graph.device import DeviceCSR
    from pitgen.graph.formats import load_graph

    from .graphs import gnn_graph_files, smallest_first

    t0 = time.monotonic()
    conv: list[dict] = []
    dyn: list[dict] = []
    meta = {**r.meta, "quick": r.args.quick}
    for name, path in gnn_graph_files(smallest_first(r.args.quick, QUICK_GRAPHS), r.args.graphs):
        csr = load_graph(path)
        for dtype in DTYPES:
            tdt = getattr(torch, dtype)
            d = DeviceCSR(csr.shape, torch.from_numpy(csr.indptr.astype("int32")).cuda(),
                          torch.from_numpy(csr.indices.astype("int32")).cuda(),
                          torch.randn(csr.nnz, device="cuda").to(tdt))
            conv.append(conversions(r, name, d, dtype))
            dyn.append(dynamic(r, name, d, dtype))
            c, y = conv[-1], dyn[-1]
            print(f"dynamic {name} {dtype}: hyb {c['convert']['hyb']['gpu_ms']:.4f} ms = "
                  f"{c['hyb_ratio']:.2f}x SpMM; new graph per call {fmt_x(y['speedup'])} "
                  f"(wall {fmt_x(y['wall_speedup'])}) vs the faster torch build",
                  file=sys.stderr, flush=True)
            del d
            torch.cuda.empty_cache()
        meta["elapsed_s"] = time.monotonic() - t0
        write(r.out, conv, dyn, meta)
    print((r.out / "dynamic.md").read_text().split("| graph |")[0])
    return 0 if all(x["ok"] for x in dyn) else 1
