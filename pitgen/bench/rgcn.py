"""RGCN inference layer (``pitgen bench rgcn``): ``Y = sum_r A_r X W_r`` on the four RGCN graphs
(pitgen.graphs: aifb, mutag, bgs, am with their relation counts), pitgen against two pure-torch
layers as the frameworks write them, in one run, same dtype.

Systems (each maps (graph, X, W) to Y; graph structures built once, outside the timing):
- ``pitgen``: :func:`pitgen.ops.rgcn.rgcn` with ``order="auto"`` (the cost model's choice), and
  each order forced, to show what the model chose against what it could have; the model's
  estimate of each order (exact layouts) is recorded beside the times, to recalibrate it;
- ``torch loop``: per relation ``torch.sparse.mm(A_r, X) @ W_r`` accumulated (cuSPARSE CSR per
  relation; PyG's and DGL's low-memory RGCN);
- ``torch typed``: edges sorted by relation, ``torch._grouped_mm(X[src], W, offs)`` per edge,
  scaled and ``index_add_`` to the targets (the gathered typed-matmul form); a dtype that
  ``_grouped_mm`` refuses is reported as not run. Its one fast path (CUTLASS, sm90) is bf16;
  fp32 and fp16, the dtypes compared here, run torch's fallback (offsets copied to the host,
  one matmul per relation), which is also what a loop of ``torch.mm`` would do. Casting to bf16
  would change the dtype compared (and miss fp32's tolerance), so each case runs its dtype.

Every result is checked against the loop peer computed in float32 from the same inputs.
Times: GPU (CUDA events, median, L2 flushed) and eager wall time per call (``Timer.both``).
Writes rgcn.md and rgcn.json.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pitgen.graphs import GRAPHS, RGCN_GRAPHS, make_relational

from .report import fmt, md_table, rel_err, speedup_summary, speedup_table, write_json

if TYPE_CHECKING:
    from .suite import Run

DTYPES = ("float32", "float16")
FEATS = (32, 64)
QUICK_FEATS = (32,)
TOL = {"float32": 1e-4, "float16": 1e-2}
TARGET = 2.0


def flop(nnz: int, compact: int, f_in: int, f_out: int) -> int:
    """Useful FLOPs of the layer: the grouped transform of the compact rows plus the SpMM."""
    return 2 * compact * f_in * f_out + 2 * nnz * min(f_in, f_out)


def loop_peer(mats: list, x: Any, w: Any) -> Any:
    """sum_r (A_r @ X) @ W_r, one cuSPARSE SpMM and one matmul per non-empty relation."""
    import torch
    y = torch.zeros((mats[0][1].shape[0], w.shape[2]), dtype=x.dtype, device=x.device)
    for r, a in mats:
        y.addmm_(torch.sparse.mm(a, x), w[r])
    return y


def typed_peer(src: Any, dst: Any, val: Any, ends: Any, rows: int, x: Any, w: Any) -> Any:
    """Per-edge messages by one grouped matmul over relation-sorted edges, added to targets."""
    import torch
    msg = torch._grouped_mm(x[src], w, offs=ends) * val[:, None]
    return torch.zeros((rows, w.shape[2]), dtype=x.dtype, device=x.device).index_add_(0, dst, msg)


def run_graph(r: Run, name: str, feats: tuple[int, ...]) -> list[dict]:
    import torch

    from pitgen.ops.rgcn import ORDERS, DeviceRelational, rgcn

    g = make_relational(name)
    rels, rows, cols = g.shape
    out = []
    for dtype in DTYPES:
        tdt = getattr(torch, dtype)
        gen = torch.Generator(device="cuda").manual_seed(0)
        d = DeviceRelational.from_host(g, dtype)
        d.values.copy_((torch.rand(g.nnz, device="cuda", generator=gen) + 0.5).to(tdt))
        rel, row, col, val = d.rel.long(), d.row.long(), d.col.long(), d.values
        mats = []
        ends = torch.cumsum(torch.tensor(d.relation_nnz(), device="cuda"), 0)
        starts = ends - torch.tensor(d.relation_nnz(), device="cuda")
        for rr, (lo, hi) in enumerate(zip(starts.tolist(), ends.tolist())):
            if hi > lo:
                idx = torch.stack([row[lo:hi], col[lo:hi]])
                a = torch.sparse_coo_tensor(idx, val[lo:hi], (rows, cols)).coalesce()
                mats.append((rr, a.to_sparse_csr()))
        order = torch.argsort(rel, stable=True)   # typed peer: edges by relation
        src, dst, tval = col[order], row[order], val[order]
        offs = ends.to(torch.int32)
        for feat in feats:
            x = torch.randn(cols, feat, device="cuda", generator=gen).to(tdt)
            w = (torch.randn(rels, feat, feat, device="cuda", generator=gen) * feat ** -0.5).to(tdt)
            ref = loop_peer([(i, a.to(torch.float32)) for i, a in mats], x.float(), w.float())
            y = torch.full((rows, feat), float("nan"), dtype=tdt, device="cuda")
            case = {"graph": name, "nodes": rows, "edges": g.nnz, "relations": rels,
                    "dtype": dtype, "feat": feat}
            plan = d.plan(feat, feat)   # estimated compact sizes: what "auto" runs first
            times = {}
            for o in ("auto", *ORDERS):
                rgcn(d, x, w, order=o, out=y)
                err = rel_err(y, ref)
                t = r.timer.both(lambda o=o: rgcn(d, x, w, order=o, out=y))
                times[o] = {"gpu_ms": t.gpu_ms, "wall_ms": t.wall_ms, "rel_err": err}
            exact = d.plan(feat, feat)   # both orders composed now: exact compact sizes
            case["choice"], case["exact_choice"] = plan.order, exact.order
            case["compact"] = exact.compact
            case["model_ms"] = {o: exact.costs[o] * 1e3 for o in ORDERS}
            case["longest"] = {o: list(lay.longest) for o, lay in exact.layouts.items()}
            case["pitgen"] = times
            case["flop"] = flop(g.nnz, case["compact"][case["choice"]], feat, feat)
            peers = {}
            t = r.timer.both(lambda: loop_peer(mats, x, w))
            peers["torch loop"] = {"gpu_ms": t.gpu_ms, "wall_ms": t.wall_ms,
                                   "rel_err": rel_err(loop_peer(mats, x, w), ref)}
            try:
                e = rel_err(typed_peer(src, dst, tval, offs, rows, x, w), ref)
                t = r.timer.both(lambda: typed_peer(src, dst, tval, offs, rows, x, w))
                peers["torch typed"] = {"gpu_ms": t.gpu_ms, "wall_ms": t.wall_ms, "rel_err": e}
            except RuntimeError as exc:
                peers["torch typed"] = {"note": f"not run: {str(exc).splitlines()[0][:90]}"}
            case["peers"] = peers
            ok_peers = [p["gpu_ms"] for p in peers.values()
                        if "gpu_ms" in p and p["rel_err"] <= TOL[dtype]]
            case["best_peer_ms"] = min(ok_peers) if ok_peers else None
            case["ok"] = all(v["rel_err"] <= TOL[dtype] for v in times.values())
            best_peer_wall = min((p["wall_ms"] for p in peers.values() if "wall_ms" in p),
                                 default=None)
            case["speedup"] = (case["best_peer_ms"] / times["auto"]["gpu_ms"]
                               if case["best_peer_ms"] else None)
            case["wall_speedup"] = (best_peer_wall / times["auto"]["wall_ms"]
                                    if best_peer_wall else None)
            out.append(case)
            print(f"rgcn {name} {dtype} F={feat}: pitgen {times['auto']['gpu_ms']:.4f} ms "
                  f"({case['choice']}), best peer {fmt(case['best_peer_ms'], 4)} ms, err "
                  f"{times['auto']['rel_err']:.1e}", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    return out


def summary(rows: list[dict]) -> list[dict]:
    """Geometric-mean speed-ups per dtype against the target."""
    return speedup_summary(rows, DTYPES, TARGET)


def write(out: Path, rows: list[dict], meta: dict) -> None:
    summ = summary(rows)
    write_json(out / "rgcn.json", {"meta": meta, "summary": summ, "rows": rows})
    lines = ["# RGCN inference layer: pitgen vs pure-torch RGCN", "",
             f"Device: **{meta['device']}** (torch {meta['torch']}, CUDA {meta['cuda']}); "
             f"{meta['date']}. Y = sum_r A_r X W_r, F_in = F_out = F, graphs from "
             "`pitgen.graphs` (docs/graphs.md), edge values in [0.5, 1.5). GPU ms: median of "
             f"{meta['repeats']} runs (CUDA events, L2 flushed); wall ms: eager, per call. "
             "Speed-up = faster correct peer / pitgen `auto`.", "",
             "## Geometric means", ""]
    lines += speedup_table(summ)
    lines += ["", "## Cases", ""] + md_table(
        ["graph", "edges", "R", "dtype", "F", "pitgen auto ms (wall)", "choice", "transform-first",
         "aggregate-first", "model ms (TF / AF)", "torch loop ms (wall)",
         "torch typed ms (wall)", "speed-up", "rel err"],
        [[x["graph"], x["edges"], x["relations"], x["dtype"], x["feat"],
          f"{fmt(x['pitgen']['auto']['gpu_ms'], 4)} ({fmt(x['pitgen']['auto']['wall_ms'], 3)})",
          x["choice"], fmt(x["pitgen"]["transform-first"]["gpu_ms"], 4),
          fmt(x["pitgen"]["aggregate-first"]["gpu_ms"], 4),
          " / ".join(fmt(v, 3) for v in x["model_ms"].values()),
          *[(f"{fmt(p['gpu_ms'], 4)} ({fmt(p['wall_ms'], 3)})" if "gpu_ms" in p else p["note"])
            for p in (x["peers"]["torch loop"], x["peers"]["torch typed"])],
          f"{fmt(x['speedup'], 2)}x",
          f"{x['pitgen']['auto']['rel_err']:.1e}" + ("" if x["ok"] else " **WRONG**")]
         for x in rows])
    (out / "rgcn.md").write_text("\n".join(lines) + "\n")


def run(r: Run) -> int:
    """The four graphs, smallest first (quick: AM left out, F = 32); files rewritten after
    every graph."""
    t0 = time.monotonic()
    names = sorted(RGCN_GRAPHS, key=lambda n: GRAPHS[n].edges)
    if r.args.quick:
        names = names[:-1]
    rows: list[dict] = []
    meta = {**r.meta, "quick": r.args.quick}
    for name in names:
        rows += run_graph(r, name, QUICK_FEATS if r.args.quick else FEATS)
        meta["elapsed_s"] = time.monotonic() - t0
        write(r.out, rows, meta)
    print((r.out / "rgcn.md").read_text().split("## Cases")[0])
    return 0 if all(x["ok"] for x in rows) else 1
