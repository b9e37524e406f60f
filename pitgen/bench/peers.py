"""pitgen against its peers on PIT's and SparseTIR's workloads (``pitgen bench peers``):
PIT's sparse-matmul micro-benchmark against cuBLAS, cuSPARSE, PyTorch's Triton BSR and stk
(MegaBlocks); a Switch-base MoE layer; BERT linear layers on padded batches of dynamic length;
OPT's fc2 on ReLU-sparse activations (the GPU side is :mod:`pitgen.bench.workloads`).

A system that synchronises with the host (cuSPARSE and BSR conversions, stk, the loop over
experts) has that wait inside its time. Writes per workload a Markdown table, a PNG plot and the
raw CSV, plus summary.md (headline table and targets) and bench.json (everything, for
``--replot``, which needs no GPU); when that makes more than 8 files, also bench_results.tar
bundling them. Results are written after every workload, and the time budget skips what is left
so that a run cut short still leaves its files.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tarfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from .report import (describe, fmt, fmt_e, fmt_x, legend, md_table, plot as draw, write_csv,
                     write_json)

if TYPE_CHECKING:
    from .suite import Run

WORKLOADS = ("micro", "seqlen", "ffn", "moe")  # moe last: its peers are the least robust
GRANULARITIES = ("1x1", "32x1", "1x64", "32x64")
MAX_FILES = 8
NAMES = {
    "dense": "cuBLAS dense", "cusparse": "cuSPARSE CSR", "bsr": "torch BSR (Triton)",
    "stk": "stk (MegaBlocks)", "pitgen-auto": "pitgen auto", "pitgen-tile": "pitgen micro-tile",
    "loop": "torch loop over experts", "grouped-fp16": "torch._grouped_mm fp16",
    "grouped-bf16": "torch._grouped_mm bf16", "pitgen-experts": "pitgen per expert (public API)",
    "pitgen-shared": "pitgen shared routing index", "pitgen-fused": "pitgen fused layer (moe_ffn)",
    "packed": "torch unpadded (gather+mm+scatter)",
}
#: One colour per system in every plot.
COLORS = {"dense": "C7", "loop": "C7", "cusparse": "C0", "grouped-fp16": "C0", "bsr": "C1",
          "grouped-bf16": "C1", "packed": "C1", "stk": "C2", "pitgen-auto": "C3",
          "pitgen-shared": "C3", "pitgen-tile": "C4", "pitgen-experts": "C4",
          "pitgen-fused": "C5"}
#: Peers a pitgen row is compared with ("best peer"); in micro the sparse libraries only.
PEERS = {"micro": ("cusparse", "bsr", "stk"),
         "moe": ("loop", "grouped-fp16", "grouped-bf16", "stk"),
         "seqlen": ("dense", "packed"), "ffn": ("dense",)}
#: The row every speed-up is over ("vs base").
BASELINE = {"micro": "dense", "moe": "loop", "seqlen": "dense", "ffn": "dense"}
CELL = {"micro": ("size", "granularity", "sparsity"), "moe": ("experts",),
        "seqlen": ("pad", "out_features"), "ffn": ("bias",)}
ORDER = {"micro": ("dense", "cusparse", "bsr", "stk", "pitgen-auto", "pitgen-tile"),
         "moe": ("loop", "grouped-fp16", "grouped-bf16", "stk", "pitgen-fused", "pitgen-experts",
                 "pitgen-shared"),
         "seqlen": ("dense", "packed", "pitgen-auto", "pitgen-tile"),
         "ffn": ("dense", "pitgen-auto", "pitgen-tile")}


def parse_workloads(text: str) -> list[str]:
    """--workloads: a comma-separated subset of WORKLOADS, returned in run order."""
    names = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown workload(s) {bad or text!r}; "
                                         f"choose from {','.join(WORKLOADS)}")
    return [w for w in WORKLOADS if w in names]


def params(quick: bool, repeats: int) -> dict:
    """What each workload runs; --quick keeps every kind of configuration but fewer of them."""
    return {
        "repeats": repeats,
        "micro": {"sizes": [4096] if quick else [4096, 8192], "grans": list(GRANULARITIES),
                  "sparsities": [0, 50, 90, 95, 99]},
        "moe": {"experts_list": [64] if quick else [64, 128], "tokens": 4096, "hidden": 768,
                "ffn": 3072},
        "seqlen": {"pads": [128, 512], "outs": [768, 3072], "batch": 32, "hidden": 768},
        "ffn": {"tokens": 1024 if quick else 2048, "hidden": 4096, "ffn_dim": 16384},
    }


def steps(p: dict, workloads: Iterable[str]) -> int:
    """Configurations to run: one progress step each."""
    mi = p["micro"]
    n = {"micro": len(mi["sizes"]) * len(mi["grans"]) * len(mi["sparsities"]),
         "moe": len(p["moe"]["experts_list"]),
         "seqlen": len(p["seqlen"]["pads"]) * len(p["seqlen"]["outs"]), "ffn": 2}
    return sum(n[w] for w in workloads)


# -- derived columns --------------------------------------------------------------------------

def total_of(row: dict) -> float | None:
    """The time a system is compared by: measured end to end where it was (pitgen's whole
    call; a MoE layer), else its conversion plus its compute."""
    if row.get("total_ms") is not None:
        return row["total_ms"]
    if row.get("call_ms") is not None:
        return row["call_ms"]
    if row.get("compute_ms") is not None:
        return (row.get("conv_ms") or 0.0) + row["compute_ms"]
    return None


def _cells(wl: str, rows: list[dict]) -> dict[tuple, list[dict]]:
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault(tuple(r.get(k) for k in CELL[wl]), []).append(r)
    return cells


def _ideal(wl: str, row: dict, base_ms: float | None) -> float | None:
    """Density x dense time (micro, seqlen, ffn); the weight-read floor for MoE."""
    if wl == "moe":
        return row.get("floor_ms")
    density = {"micro": row.get("density"), "seqlen": row.get("valid_frac"),
               "ffn": None if row.get("act_sparsity") is None else 1 - row["act_sparsity"]}[wl]
    return None if density is None or base_ms is None else density * base_ms


def derive(results: dict[str, list[dict]]) -> None:
    """Fill total_ms, ideal_ms, vs_base, vs_ideal and (pitgen rows) best_peer, vs_peer.
    Only rows with status 'ok' serve as baseline or peer."""
    for wl, rows in results.items():
        for r in rows:
            if r.get("status") in ("ok", "wrong"):
                r["total_ms"] = total_of(r)
                if r.get("compute_ms") is not None:
                    r["sum_ms"] = (r.get("conv_ms") or 0.0) + r["compute_ms"]
        for cell in _cells(wl, rows).values():
            ok = {r["system"]: r for r in cell
                  if r.get("status") == "ok" and r.get("total_ms") is not None}
            base = ok.get(BASELINE[wl])
            base_ms = base["total_ms"] if base else None
            peers = [ok[s] for s in PEERS[wl] if s in ok]
            best = min(peers, key=lambda r: r["total_ms"]) if peers else None
            for r in cell:
                t = r.get("total_ms")
                if t is None:
                    continue
                ideal = _ideal(wl, r, base_ms)
                if base_ms is not None and t > 0:
                    r["vs_base"] = base_ms / t
                if ideal:
                    r["ideal_ms"], r["vs_ideal"] = ideal, t / ideal
                if best is not None and r["system"].startswith("pitgen") and t > 0:
                    r["best_peer"], r["vs_peer"] = best["system"], best["total_ms"] / t


# -- targets ----------------------------------------------------------------------------------

def _pitgen_row(cell: dict[str, dict], which: str) -> dict | None:
    """pitgen's row of a cell: 'auto', or 'best' of auto and the explicit micro-tile."""
    if which == "auto":
        return cell.get("pitgen-auto")
    ok = [cell[s] for s in ("pitgen-auto", "pitgen-tile")
          if s in cell and cell[s].get("status") == "ok" and cell[s].get("total_ms")]
    return min(ok, key=lambda r: r["total_ms"]) if ok else cell.get("pitgen-auto")


def _against(cell: dict[str, dict], what: str) -> tuple[str, float] | None:
    """(name, ms) of what pitgen is compared with in a cell; None without a usable row."""
    def usable(r: dict | None) -> bool:
        return bool(r) and r.get("status") == "ok" and bool(r.get("total_ms"))

    if what == "best":
        peers = [cell[s] for s in PEERS["micro"] if usable(cell.get(s))]
        b = min(peers, key=lambda r: r["total_ms"]) if peers else None
        return (b["system"], b["total_ms"]) if b else None
    if what == "ideal":
        dense = cell.get("dense")
        return ("ideal", dense["density"] * dense["total_ms"]) if usable(dense) else None
    return (what, cell[what]["total_ms"]) if usable(cell.get(what)) else None


def _div(a: float, b: float) -> float:
    return a / b if b else math.inf


#: (target, sparsities it applies to, compared with, ratio(pitgen ms, other ms), bound, test)
TARGETS = (
    ("3x faster than the fastest sparse peer (cuSPARSE, BSR, stk; conversion included)",
     lambda sp: sp >= 90, "best", lambda p, o: _div(o, p), ">= 3", lambda v: v >= 3),
    ("10x faster than cuSPARSE (conversion included)",
     lambda sp: sp >= 90, "cusparse", lambda p, o: _div(o, p), ">= 10", lambda v: v >= 10),
    ("within 2.5x of the ideal (density x dense cuBLAS time)",
     lambda sp: sp >= 90, "ideal", lambda p, o: _div(p, o), "<= 2.5", lambda v: v <= 2.5),
    ("at 0% sparsity, auto at most 10% slower than dense cuBLAS",
     lambda sp: sp == 0, "dense", lambda p, o: _div(p, o), "<= 1.10", lambda v: v <= 1.10),
)


def _verdict(checks: list[dict]) -> str:
    judged = [c for c in checks if c["met"] is not None]
    miss = sum(c["met"] is False for c in judged)
    if not judged:
        return "not evaluated (no data)"
    if miss:
        return f"NOT reached ({miss} of {len(checks)} cells miss)"
    if len(judged) < len(checks):
        return f"not established ({len(checks) - len(judged)} of {len(checks)} cells lack data)"
    return f"reached (all {len(checks)} cells)"


def micro_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets per (size, granularity, sparsity) cell, judged for pitgen auto and
    for the better of auto and the explicit micro-tile ('best'). A cell whose pitgen row failed
    or is wrong misses; one without the row it is compared with has no verdict."""
    cells = sorted(((k, {r["system"]: r for r in v}) for k, v in _cells("micro", rows).items()),
                   key=lambda kv: _sort_key(kv[0]))
    out = []
    for title, applies, what, ratio, bound, test in TARGETS:
        checks: dict[str, list[dict]] = {"auto": [], "best": []}
        whiches = ("auto",) if what == "dense" else ("auto", "best")
        for (size, gran, sp), cell in cells:
            if not applies(sp):
                continue
            oth = _against(cell, what)
            for which in whiches:
                pit = _pitgen_row(cell, which)
                c = {"size": size, "granularity": gran, "sparsity": sp,
                     "pitgen": pit["system"] if pit else None,
                     "against": oth[0] if oth else None, "against_ms": oth[1] if oth else None,
                     "met": None}
                if not pit or pit.get("status") != "ok" or not pit.get("total_ms"):
                    c.update(met=False, why=f"pitgen {pit.get('status') if pit else 'missing'}")
                elif oth is None:
                    c.update(pitgen_ms=pit["total_ms"], why=f"no {what} time")
                else:
                    c.update(pitgen_ms=pit["total_ms"], value=ratio(pit["total_ms"], oth[1]))
                    c["met"] = test(c["value"])
                checks[which].append(c)
        out.append({"target": title, "bound": bound, "cells": checks,
                    "verdicts": {w: _verdict(checks[w]) for w in whiches}})
    return out


# -- Markdown ---------------------------------------------------------------------------------

def _status(r: dict, width: int = 160) -> str:
    st = r.get("status")
    if st == "ok":
        return "ok"
    if st == "wrong":
        return "**WRONG** (disqualified)"
    if st == "error":
        return "error: " + str(r.get("error", ""))[:width]
    return f"{st}: {r.get('note', '')}"


def _sort_key(key: tuple) -> tuple:
    return tuple((GRANULARITIES.index(v), "") if v in GRANULARITIES else (0, v) for v in key)


def _ordered(wl: str, rows: list[dict]) -> list[dict]:
    rank = {s: i for i, s in enumerate(ORDER[wl])}
    return sorted(rows, key=lambda r: (_sort_key(tuple(r.get(k) for k in CELL[wl])),
                                       rank.get(r.get("system"), 99)))


def _name(r: dict) -> str:
    return NAMES.get(r.get("system"), str(r.get("system")))


def _header(title: str, meta: dict, p: dict) -> list[str]:
    return [f"# {title}", "",
            f"{meta.get('device', '?')}, driver {meta.get('driver', '?')}, CUDA "
            f"{meta.get('cuda', '?')}, torch {meta.get('torch', '?')}, triton "
            f"{meta.get('triton', '?')}, stk {meta.get('stk', '?')}, pitgen "
            f"{meta.get('pitgen', '?')}; {meta.get('mode', '?')} run, median of "
            f"{p.get('repeats', '?')} (cuSPARSE: at most 5), L2 flushed, device time "
            f"(CUDA events). Times in ms; 'total' is pitgen's whole call, else conversion + "
            f"compute.", ""]


def micro_md(rows: list[dict], meta: dict, p: dict) -> str:
    lines = _header("Sparse matmul micro-benchmark (PIT's): C = A @ B, fp16, A sparse", meta, p)
    for size in sorted({r["size"] for r in rows}):
        lines += [f"## {size} x {size} x {size}", ""]
        body = [[r["granularity"], f"{r['sparsity']:g}%", _name(r), r.get("variant", ""),
                 fmt(r.get("conv_ms"), 4), fmt(r.get("compute_ms"), 4), fmt(r.get("sum_ms"), 4),
                 fmt(r.get("call_ms"), 4), fmt(r.get("total_ms"), 4), fmt(r.get("ideal_ms"), 4),
                 fmt_x(r.get("vs_base")), fmt(r.get("vs_ideal"), 2), fmt_e(r.get("rel_err")), _status(r)]
                for r in _ordered("micro", [r for r in rows if r["size"] == size])]
        lines += md_table(["granularity", "sparsity", "system", "variant", "conversion / index",
                           "compute", "sum", "pitgen call", "total", "ideal", "vs dense",
                           "total / ideal", "rel err", "status"], body) + [""]
    return "\n".join(lines)


def moe_md(rows: list[dict], meta: dict, p: dict) -> str:
    lines = _header("MoE layer (Switch-base): tokens -> expert FFN (768 -> 3072 -> 768), top-1",
                    meta, p)
    lines += ["Every system maps (X, expert id per token) to Y, routing gather/scatter included. "
              "'total' is device time with host launches hidden; 'host' is wall-clock per call "
              "back to back. Floor: reading every expert's weights once at the measured copy "
              "rate.", ""]
    for n in sorted({r["experts"] for r in rows}):
        sub = [r for r in rows if r["experts"] == n]
        r0 = sub[0]
        lines += [f"## {n} experts", "",
                  f"{r0.get('tokens')} tokens; tokens per expert max {r0.get('max_tokens', '-')}, "
                  f"min {r0.get('min_tokens', '-')}, {r0.get('empty_experts', '-')} empty; "
                  f"weight-read floor {fmt(r0.get('floor_ms'))} ms", ""]
        body = [[_name(r), r.get("dtype", ""), fmt(r.get("conv_ms"), 4), fmt(r.get("total_ms")),
                 fmt(r.get("host_ms")), fmt_x(r.get("vs_base")), fmt(r.get("vs_ideal"), 2),
                 fmt_e(r.get("rel_err")), _status(r),
                 r.get("note", "") if r.get("status") in ("ok", "wrong") else ""]
                for r in _ordered("moe", sub)]
        lines += md_table(["system", "dtype", "index", "total", "host", "vs loop",
                           "total / floor", "rel err", "status", "note"], body) + [""]
    return "\n".join(lines)


def seqlen_md(rows: list[dict], meta: dict, p: dict) -> str:
    lines = _header("Dynamic sequence length: BERT-base linear layers on a padded batch", meta, p)
    for pad in sorted({r["pad"] for r in rows}):
        sub = [r for r in rows if r["pad"] == pad]
        r0 = sub[0]
        lines += [f"## padded to {pad}", "",
                  f"batch {r0.get('batch')}, mean length {fmt(r0.get('mean_len'), 1)}, longest "
                  f"{r0.get('max_len')}, valid tokens {fmt(100 * r0['valid_frac'], 1)}%", ""]
        body = [[f"{r['hidden']}->{r['out_features']}", _name(r), r.get("variant", ""),
                 fmt(r.get("conv_ms"), 4), fmt(r.get("compute_ms"), 4), fmt(r.get("call_ms"), 4),
                 fmt(r.get("total_ms"), 4), fmt(r.get("ideal_ms"), 4), fmt_x(r.get("vs_base")),
                 fmt(r.get("vs_ideal"), 2), fmt_e(r.get("rel_err")), _status(r)]
                for r in _ordered("seqlen", sub)]
        lines += md_table(["layer", "system", "variant", "index", "compute", "pitgen call",
                           "total", "ideal", "vs dense", "total / ideal", "rel err", "status"],
                          body) + [""]
    return "\n".join(lines)


def ffn_md(rows: list[dict], meta: dict, p: dict) -> str:
    lines = _header("Activation sparsity: OPT-style fc2 after ReLU, Y = relu(H W1 + b) W2", meta, p)
    for bias in [b for b in ("uniform", "per-neuron") if any(r["bias"] == b for r in rows)]:
        sub = [r for r in rows if r["bias"] == bias]
        r0 = sub[0]
        lines += [f"## {bias} bias", ""]
        if r0.get("act_sparsity") is not None:
            lines += [f"tokens {r0.get('tokens')}, {r0.get('hidden')} -> {r0.get('ffn')}; bias "
                      f"N({fmt(r0.get('bias_mu'), 3)}, {fmt(r0.get('bias_sd'), 1)}^2) per neuron; "
                      f"zeros after ReLU {fmt(100 * r0['act_sparsity'], 1)}%, all-zero 32x1 "
                      f"micro-tiles {fmt(100 * r0['zero_tiles_32x1'], 1)}%, all-zero columns "
                      f"{fmt(100 * r0['zero_columns'], 1)}%", ""]
        body = [[_name(r), r.get("variant", ""), fmt(r.get("conv_ms"), 4),
                 fmt(r.get("compute_ms"), 4), fmt(r.get("call_ms"), 4), fmt(r.get("total_ms"), 4),
                 fmt(r.get("ideal_ms"), 4), fmt_x(r.get("vs_base")), fmt(r.get("vs_ideal"), 2),
                 fmt_e(r.get("rel_err")), _status(r)] for r in _ordered("ffn", sub)]
        lines += md_table(["system", "variant", "index", "compute", "pitgen call", "total",
                           "ideal", "vs dense", "total / ideal", "rel err", "status"], body) + [""]
    return "\n".join(lines)


MD = {"micro": micro_md, "moe": moe_md, "seqlen": seqlen_md, "ffn": ffn_md}


def summary_md(results: dict[str, list[dict]], meta: dict, p: dict, notes: list[str]) -> str:
    lines = ["# pitgen benchmarks: summary", "",
             "Produced by `pitgen bench peers` (see README.md beside this file).", "",
             "## Machine and method", ""]
    lines += [f"- {k}: {str(v).replace(chr(10), ' ')}" for k, v in meta.items()]
    lines += ["- timing: CUDA events, warm-up, median, 256 MB written before each run (L2 "
              "flush), host launches hidden by a spin queued ahead of the start event; host "
              "synchronisations a system needs are inside its time", ""]
    if "micro" in results:
        lines += _micro_headline(results["micro"]) + _targets_md(micro_targets(results["micro"]))
    for wl, title in (("moe", "MoE layer"), ("seqlen", "Dynamic sequence length"),
                      ("ffn", "Activation sparsity (fc2)")):
        if wl in results:
            lines += _headline(wl, title, results[wl])
    failed: dict[tuple, list[str]] = {}
    for wl, rows in results.items():
        for r in rows:
            if r.get("status") != "ok":
                where = " ".join(str(r.get(k)) for k in CELL[wl])
                failed.setdefault((wl, _name(r), _status(r)), []).append(where)
    if failed or notes:
        lines += ["## Not ok (wrong, failed or skipped)", ""] + [f"- {n}" for n in notes]
        lines += [f"- {wl} {name}: {status} ({len(where)}: {', '.join(where[:6])}"
                  f"{', ...' if len(where) > 6 else ''})"
                  for (wl, name, status), where in failed.items()]
        lines.append("")
    return "\n".join(lines)


def _micro_headline(rows: list[dict]) -> list[str]:
    lines = ["## Micro-benchmark headline", "",
             "Total = conversion/index + compute (pitgen: its whole call); best peer among "
             "cuSPARSE, torch BSR and stk, conversion included.", ""]
    cells = {k: {r["system"]: r for r in v} for k, v in _cells("micro", rows).items()}
    body = []
    for (size, gran, sp), c in sorted(cells.items(), key=lambda kv: _sort_key(kv[0])):
        dense = c.get("dense", {})
        auto, tile = c.get("pitgen-auto", {}), c.get("pitgen-tile", {})
        peer = auto.get("best_peer") or tile.get("best_peer")

        def t(r: dict) -> str:
            return fmt(r.get("total_ms"), 4) if r.get("status") == "ok" else r.get("status", "-")

        body.append([f"{size}", gran, f"{sp:g}%", t(dense),
                     f"{NAMES.get(peer, '-')} {t(c.get(peer, {}))}" if peer else "-",
                     t(auto), auto.get("variant", "").split("-> ")[-1], t(tile),
                     fmt_x(auto.get("vs_base")), fmt_x(auto.get("vs_peer")), fmt(auto.get("ideal_ms"), 4)])
    return lines + md_table(["size", "granularity", "sparsity", "dense", "best peer",
                             "pitgen auto", "auto's choice", "pitgen micro-tile",
                             "auto vs dense", "auto vs best peer", "ideal"], body) + [""]


def _targets_md(targets: list[dict]) -> list[str]:
    lines = ["## Targets", "",
             "Judged per (size, granularity, sparsity) for pitgen auto, and for the better of "
             "auto and the explicit micro-tile ('best'). Times are totals (conversion or index "
             "included).", ""]
    met = {True: "yes", False: "**no**", None: "n/a"}
    for t in targets:
        lines += [f"### {t['target']}", ""]
        lines += [f"- pitgen {w}: **{v}**" for w, v in t["verdicts"].items()] + [""]
        best = {(c["size"], c["granularity"], c["sparsity"]): c
                for c in t["cells"].get("best", [])}
        head = ["size", "granularity", "sparsity", "against", "ms", "auto ms",
                f"ratio ({t['bound']})", "met"]
        if best:
            head += ["best", "ms", "ratio", "met"]
        body = []
        for c in t["cells"]["auto"]:
            row = [str(c["size"]), c["granularity"], f"{c['sparsity']:g}%",
                   NAMES.get(c["against"], c["against"] or "-"), fmt(c["against_ms"], 4),
                   fmt(c.get("pitgen_ms"), 4), fmt(c.get("value"), 2),
                   met[c["met"]] + (f" ({c['why']})" if c.get("why") else "")]
            b = best.get((c["size"], c["granularity"], c["sparsity"]))
            if b:
                row += [NAMES.get(b["pitgen"], "-"), fmt(b.get("pitgen_ms"), 4),
                        fmt(b.get("value"), 2),
                        met[b["met"]] + (f" ({b['why']})" if b.get("why") else "")]
            body.append(row)
        lines += md_table(head, body) + [""]
    return lines


def _headline(wl: str, title: str, rows: list[dict]) -> list[str]:
    body = [[" ".join(f"{k}={r.get(k)}" for k in CELL[wl]), _name(r), fmt(r.get("total_ms"), 4),
             fmt_x(r.get("vs_base")), fmt(r.get("vs_ideal"), 2), fmt_x(r.get("vs_peer")), r.get("status")]
            for r in _ordered(wl, rows)]
    return [f"## {title}", ""] + md_table(
        ["configuration", "system", "total ms", f"vs {NAMES[BASELINE[wl]]}",
         "total / floor" if wl == "moe" else "total / ideal", "pitgen vs best peer", "status"],
        body) + [""]


# -- plots ------------------------------------------------------------------------------------

def _value(rows: list[dict], key: str, **match: Any) -> float:
    """``key`` of the ok row whose fields equal ``match``; NaN (a gap in a line) without one."""
    v = next((r.get(key) for r in rows if r.get("status") == "ok"
              and all(r.get(k) == m for k, m in match.items())), None)
    return math.nan if v is None else v


def plot_micro(plt: Any, rows: list[dict]) -> Any:
    """Speed-up over dense per granularity and size (every system, conversion included; the
    ideal 1/density dashed), and pitgen's speed-up over the best sparse peer."""
    sizes = sorted({r["size"] for r in rows})
    grans = [g for g in GRANULARITIES if any(r["granularity"] == g for r in rows)]
    sps = sorted({r["sparsity"] for r in rows})
    fig, axes = plt.subplots(len(sizes) + 1, len(grans), squeeze=False, sharex=True,
                             figsize=(4 * len(grans), 3.2 * (len(sizes) + 1)))
    xs = list(range(len(sps)))
    for i, size in enumerate(sizes):
        for j, gran in enumerate(grans):
            ax = axes[i][j]
            cell = [r for r in rows if r["size"] == size and r["granularity"] == gran]
            for s in ORDER["micro"][1:]:
                ys = [_value(cell, "vs_base", system=s, sparsity=sp) for sp in sps]
                if not all(math.isnan(y) for y in ys):
                    ax.plot(xs, ys, marker="o", color=COLORS[s], label=NAMES[s])
            dens = [_value(cell, "density", system="dense", sparsity=sp) for sp in sps]
            ax.plot(xs, [1 / d if d else math.nan for d in dens], "k--",
                    label="ideal (1 / density)")
            ax.axhline(1, color="gray", lw=0.8)
            ax.set_yscale("log")
            ax.set_title(f"{size}^3, {gran} pattern")
            if j == 0:
                ax.set_ylabel("speed-up over dense cuBLAS")
    for j, gran in enumerate(grans):
        ax = axes[-1][j]
        for size, style in zip(sizes, ("-", "--", ":")):
            for s in ("pitgen-auto", "pitgen-tile"):
                ys = [_value(rows, "vs_peer", size=size, granularity=gran, system=s, sparsity=sp)
                      for sp in sps]
                if not all(math.isnan(y) for y in ys):
                    ax.plot(xs, ys, style, marker="o", color=COLORS[s], label=f"{NAMES[s]}, {size}")
        ax.axhline(1, color="gray", lw=0.8)
        ax.axhline(3, color="red", lw=0.8, ls=":", label="target 3x")
        ax.set_yscale("log")
        ax.set_title(f"pitgen vs best sparse peer, {gran}")
        ax.set_xticks(xs, [f"{s:g}%" for s in sps])
        ax.set_xlabel("sparsity")
        if j == 0:
            ax.set_ylabel("speed-up over best peer")
    legend(fig, [a for row in axes for a in row], "upper center")
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


TITLES = {"moe": "MoE layer (Switch-base, top-1)", "seqlen": "BERT linear layers, dynamic length",
          "ffn": "OPT-style fc2 after ReLU"}


def plot_bars(plt: Any, wl: str, rows: list[dict]) -> Any:
    """Left: every system's speed-up over the baseline per configuration, the ideal (or floor)
    as a black tick. Right: pitgen's speed-up over its best peer."""
    cells = sorted(_cells(wl, rows).items(), key=lambda kv: _sort_key(kv[0]))
    labels = ["\n".join(f"{k}={v}" for k, v in zip(CELL[wl], key)) for key, _ in cells]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key, systems in ((left, "vs_base", ORDER[wl]),
                             (right, "vs_peer", [s for s in ORDER[wl] if s.startswith("pitgen")])):
        width = 0.8 / len(systems)
        for k, s in enumerate(systems):
            ys = [_value(cell, key, system=s) for _, cell in cells]
            if not all(math.isnan(y) for y in ys):
                ax.bar([i + k * width for i in range(len(cells))],
                       [0 if math.isnan(y) else y for y in ys], width,
                       color=COLORS.get(s), label=NAMES.get(s, s))
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))], labels, fontsize=8)
    for i, (_, cell) in enumerate(cells):
        base_ms = _value(cell, "total_ms", system=BASELINE[wl])
        ideal = _value(cell, "ideal_ms", system=BASELINE[wl])
        if not (math.isnan(base_ms) or math.isnan(ideal)):
            left.hlines(base_ms / ideal, i - 0.1, i + 0.7, colors="k",
                        label="floor" if wl == "moe" else "ideal")
    left.set_ylabel(f"speed-up over {NAMES[BASELINE[wl]]}")
    right.set_ylabel("pitgen speed-up over best peer")
    fig.suptitle(TITLES[wl])
    legend(fig, [left, right], "lower center")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


# -- files ------------------------------------------------------------------------------------

LEAD_COLUMNS = ("workload", "size", "granularity", "sparsity", "density", "experts", "pad",
                "out_features", "bias", "system", "variant", "dtype", "conv_ms", "compute_ms",
                "call_ms", "sum_ms", "total_ms", "host_ms", "ideal_ms", "floor_ms", "vs_base",
                "vs_ideal", "best_peer", "vs_peer", "rel_err", "status", "error", "note")


def write_all(out: Path, results: dict[str, list[dict]], meta: dict, p: dict,
              notes: list[str], tar: Path | None) -> list[Path]:
    """Every output file of the results so far; the bundle too when they are more than 8.
    The raw JSON and CSVs come first; a report that fails to render is noted, never fatal
    (fix it and --replot: the measurements are in bench.json)."""
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = [out / "bench.json"]
    write_json(files[0], {"meta": meta, "params": p, "notes": notes, "results": results})
    report_notes: list[str] = []

    def attempt(path: Path, write: Callable[[Path], Any]) -> None:
        """write(path) returns a str (a note) when it could not write the file."""
        try:
            note = write(path)
        except Exception as e:
            note = f"{path.name} not written ({describe(e)})"
        if isinstance(note, str):
            report_notes.append(note)
        else:
            files.append(path)

    try:
        derive(results)
    except Exception as e:
        report_notes.append(f"derived columns not computed ({describe(e)})")
    for wl, rows in results.items():
        if rows:
            attempt(out / f"{wl}.csv", lambda path: write_csv(rows, path, LEAD_COLUMNS))
            attempt(out / f"{wl}.md", lambda path: path.write_text(MD[wl](rows, meta, p)))
            attempt(out / f"{wl}.png", lambda path: draw(path, lambda plt: (
                plot_micro(plt, rows) if wl == "micro" else plot_bars(plt, wl, rows))))
    attempt(out / "summary.md",
            lambda path: path.write_text(summary_md(results, meta, p, notes + report_notes)))
    for n in report_notes:
        print(n, file=sys.stderr)
    if len(files) > MAX_FILES:
        tar = tar or out / "bench_results.tar"
        with tarfile.open(tar, "w") as t:
            for f in files:
                t.add(f, arcname=f.name)
        files.append(tar)
    return files


def replot(folder: Path, tar: str | None = None) -> int:
    """Tables, plots and summary again from ``folder/bench.json`` (no GPU needed)."""
    data = json.loads((folder / "bench.json").read_text())
    files = write_all(folder, data["results"], data["meta"], data["params"], data["notes"],
                      Path(tar) if tar else None)
    print("\n".join(str(f) for f in files))
    return 0


# -- run --------------------------------------------------------------------------------------

def print_row(row: dict) -> None:
    """One line per measured system on stdout (the log of the run)."""
    wl = row["workload"]
    where = " ".join(str(row.get(k)) for k in CELL[wl])
    parts = [f"{wl:6} {where:22} {row['system']:15}"]
    t = total_of(row)
    if t is not None:
        parts.append(f"total {t:9.4f} ms")
    for k in ("conv_ms", "compute_ms", "host_ms"):
        if row.get(k) is not None:
            parts.append(f"{k[:-3]} {row[k]:.4f}")
    if row.get("rel_err") is not None:
        parts.append(f"err {row['rel_err']:.1e}")
    if row.get("variant"):
        parts.append(f"[{row['variant']}]")
    parts.append(_status(row, width=400))
    print(" | ".join(parts), flush=True)


def run(r: Run) -> int:
    """The selected workloads in order, files rewritten after each."""
    import torch

    from . import workloads as W
    from .report import Progress

    t0 = time.monotonic()
    budget = r.budget(500.0)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references stay float32
    p = params(r.args.quick, r.timer.repeats)
    chosen = r.args.workloads or list(WORKLOADS)
    progress = Progress(steps(p, chosen))
    meta = {**r.meta, "workloads": ",".join(chosen), "budget_s": budget}
    ctx = W.Ctx(timer=r.timer, quick=r.args.quick, step=progress.step,
                out_of_time=lambda: time.monotonic() - t0 > budget, report=print_row,
                copy_bytes_per_ms=r.ceilings.copy_bytes_per_ms)
    tar = Path(r.args.tar) if r.args.tar else None
    results: dict[str, list[dict]] = {}
    notes: list[str] = []
    with torch.no_grad():
        for wl in chosen:
            results[wl] = []
            try:
                getattr(W, wl)(ctx, results[wl], **p[wl])
            except Exception as e:  # keep what was measured, say why the rest is missing
                notes.append(f"{wl} stopped early: {describe(e)}")
                print(notes[-1], file=sys.stderr, flush=True)
            meta["elapsed_s"] = round(time.monotonic() - t0, 1)
            files = write_all(r.out, results, meta, p, notes, tar)
    print((r.out / "summary.md").read_text())
    bundle = f" (bundle {files[-1]})" if len(files) > MAX_FILES else ""
    print(f"wrote {len(files)} files to {r.out}{bundle}", file=sys.stderr)
    return 1 if any(row.get("status") == "wrong" and row["system"].startswith("pitgen")
                    for rows in results.values() for row in rows) else 0
