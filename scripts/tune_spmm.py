"""Sweep SpMM's gather unroll (neighbours whose X rows one lane requests before using any),
packs (feature vectors per lane per pass) and cut (how hyb's cut rows combine) on
the layouts and schedules ``pitgen bench graphs``'s tuner chose (docs/bench/graphs.json), against
cuSPARSE in the same run: CUDA events, median, L2 flushed. Prints one line per case and the
geometric-mean speed-up per variant; graph_ops.SPMM_UNROLL, SPMM_PACKS and SPMM_CUT follow the
results
(docs/formats.md).

    python scripts/tune_spmm.py [--results docs/bench/graphs.json] [--graphs DIR] [--skip G ...]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from pitgen.bench import Timer, fmt, geomean, rel_err
from pitgen.bench.graphs import device_csr, graph_file
from pitgen.graph import kernels as graph_ops
from pitgen.graph.device import DeviceCSR, to_format
from pitgen.render import render_template
from pitgen.runtime import precompile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="docs/bench/graphs.json")
    ap.add_argument("--graphs", default=os.path.join(tempfile.gettempdir(), "pitgen-graphs"))
    ap.add_argument("--skip", nargs="*", default=["reddit"])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    os.makedirs(args.graphs, exist_ok=True)
    rows = [r for r in json.load(open(args.results))["rows"]
            if r["op"] == "spmm" and r["graph"] not in args.skip]
    timer = Timer(args.repeats)
    print(torch.cuda.get_device_name())
    # (unroll, packs, cut): cut applies to hyb layouts with c == 1 and rows cut into pieces
    variants = [(2, 4, "atomic"), (2, 4, "pieces"), (1, 1, "atomic"), (1, 1, "pieces")]
    speed: dict[tuple[str, int, int, str], list[float]] = {}
    graphs: dict[tuple[str, str], DeviceCSR] = {}
    cases = []
    for r in rows:   # layouts and operands first, so every variant compiles in one parallel pass
        key = (r["graph"], r["dtype"])
        if key not in graphs:
            graphs[key] = device_csr(graph_file(r["graph"], args.graphs), r["dtype"])
        a = graphs[key]
        m = to_format(a, r["choice"], **r["params"])
        tdt = getattr(torch, r["dtype"])
        x = torch.randn(a.shape[1], r["feat"], device="cuda").to(tdt)
        y = torch.empty(a.shape[0], r["feat"], device="cuda", dtype=tdt)
        scheds = [{**r["schedule"], "unroll": u, "packs": p,
                   **({"cut": cut} if r["choice"] == "hyb" else {})} for u, p, cut in variants]
        cases.append((r, a, m, x, y, scheds))
    sources = {render_template("spmm.cu.j2", **graph_ops.spmm_context(
        m, s, graph_ops._vec_for(s["vec"], r["feat"], r["dtype"], x, y), r["feat"]))
        for r, a, m, x, y, scheds in cases for s in scheds}
    precompile(sources)
    print(f"{len(sources)} variants compiled", flush=True)
    for r, a, m, x, y, scheds in cases:
        a_t = a.to_torch()
        ref = torch.sparse.mm(a_t, x)
        peer = timer(lambda: torch.sparse.mm(a_t, x))
        cells = []
        for (u, p, cut), s in zip(variants, scheds):
            y.fill_(float("nan"))
            graph_ops.spmm(m, x, schedule=s, out=y)
            err = rel_err(y, ref)
            t = timer(lambda: graph_ops.spmm(m, x, schedule=s, out=y))
            speed.setdefault((r["dtype"], u, p, cut), []).append(peer / t if err < 1e-2 else None)
            cells.append(f"u{u}p{p}{cut[0]} {t:.4f} ({peer / t:.2f}x"
                         f"{'' if err < 1e-2 else ' WRONG'})")
        print(f"{r['graph']:14s} {r['dtype']} F={r['feat']:3d} {r['choice']} peer {peer:.4f} | "
              + " | ".join(cells), flush=True)
    for (dtype, u, p, cut), xs in sorted(speed.items()):
        wrong = xs.count(None)
        print(f"geomean {dtype} unroll {u} packs {p} cut {cut}: {fmt(geomean(xs))}x over "
              f"{len(xs) - wrong} cases" + (f", {wrong} WRONG" if wrong else ""))


if __name__ == "__main__":
    main()
