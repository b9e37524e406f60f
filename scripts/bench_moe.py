"""MoE expert layer benchmark: pitgen's fused layer (GPU routing index + two grouped tensor-core
GEMMs) against a PyTorch loop over experts, torch._grouped_mm and stk block-sparse (MegaBlocks
style), all timed in the same run with CUDA events (L2 flushed, median), routing included.

Workload: T=4096 tokens, H=768, F=3072, top-1, skewed (Zipf-like, seeded) expert popularity,
E = 64 and 128, fp16. Writes <out>/moe_layer.md and <out>/moe_layer.json (moe.md is bench.py's MoE workload).

    python scripts/bench_moe.py --out docs/bench
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import Timer, host_ms  # noqa: E402

FLOOR_TBPS = 3.0  # HBM bytes per second used for the weight-read floor (TB/s)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/bench", help="folder for moe_layer.md and moe_layer.json")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--experts", default="64,128")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stk-only", action="store_true",
                    help="internal: time only the stk peer and print its rows as JSON (the main "
                         "run starts this in a subprocess: a crash there cannot end the benchmark)")
    return ap.parse_args(argv)


def routing(T: int, E: int, seed: int) -> np.ndarray:
    """Top-1 expert ids with Zipf-like popularity (p_e ~ 1/(e+1)^1.1, experts shuffled)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1) ** 1.1
    perm = rng.permutation(E)
    return perm[rng.choice(E, size=(T, 1), p=p / p.sum())]


def loop_peer(x, ids, gates, w1, w2, b1, b2):
    """PyTorch loop over experts: tokens of each expert found by sorting (one sync for the
    counts), index_select, two matmuls, index_add with the gate."""
    import torch
    import torch.nn.functional as F
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    y = torch.zeros_like(x)
    start = 0
    for e, c in enumerate(counts):
        if c:
            rows = order[start:start + c]
            h = F.gelu(torch.index_select(x, 0, rows) @ w1[e] + b1[e], approximate="tanh")
            o = (h @ w2[e] + b2[e]) * gates.reshape(-1)[rows, None].to(x.dtype)
            y.index_add_(0, rows, o)
        start += c
    return y


def grouped_peer(x, ids, gates, w1, w2, b1, b2):
    """torch._grouped_mm: sort tokens by expert (GPU, no sync), offs = int32 cumulative row
    ends, two grouped GEMMs, scatter back with the gate."""
    import torch
    import torch.nn.functional as F
    E = w1.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    se = flat[order]
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    xs = x[order]
    h = torch._grouped_mm(xs, w1, offs=offs) + b1[se]
    h = F.gelu(h, approximate="tanh")
    o = (torch._grouped_mm(h, w2, offs=offs) + b2[se]) * gates.reshape(-1)[order, None].to(x.dtype)
    y = torch.empty_like(x)
    y[order] = o
    return y


def stk_peer(x, ids, gates, w1c, w2c, b1, b2, E, F_, blk=128):
    """MegaBlocks-style dMoE on stk: tokens sorted and padded per expert to 128-row blocks, a
    block-diagonal topology [padded tokens, E*F], sdd then dsd (topology built with one sync)."""
    import torch
    import torch.nn.functional as Fn
    import stk
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + blk - 1) // blk * blk
    pend = torch.cumsum(padded, 0)
    pstart = pend - padded
    order = torch.argsort(flat)
    se = flat[order]
    start = torch.cumsum(counts, 0) - counts
    dest = pstart[se] + (torch.arange(flat.numel(), device=x.device) - start[se])
    nb = (padded // blk).tolist()
    rows_total = int(sum(nb)) * blk
    xp = torch.zeros(rows_total, x.shape[1], dtype=x.dtype, device=x.device)
    xp[dest] = x[order]
    cb = F_ // blk
    row_idx, col_idx, row_blk = [], [], 0
    for e, n in enumerate(nb):
        for r in range(n):
            row_idx.extend([row_blk + r] * cb)
            col_idx.extend(range(e * cb, (e + 1) * cb))
        row_blk += n
    dev = x.device
    ri = torch.tensor(row_idx, dtype=torch.int16, device=dev)
    ci = torch.tensor(col_idx, dtype=torch.int16, device=dev)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev),
                         torch.cumsum(torch.full((rows_total // blk,), cb, device=dev), 0).to(torch.int32)])
    gather = torch.argsort(ci.long(), stable=True)
    ci_t = ri.gather(0, gather)
    offsets_t = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev),
                           torch.cumsum(torch.bincount(ci.long(), minlength=E * cb), 0).to(torch.int32)])
    data = torch.empty(len(row_idx), blk, blk, dtype=x.dtype, device=dev)
    topo = stk.Matrix((rows_total, E * F_), data, ri, ci, offsets, ci_t, offsets_t,
                      gather.to(torch.int32))
    h = stk.ops.sdd(xp, w1c, topo)
    hb = h.data.view(-1, blk, blk)
    bias = b1.reshape(E * cb, blk)[ci.long()]  # per block column
    hd = Fn.gelu(hb + bias[:, None, :], approximate="tanh")
    h = stk.Matrix(topo.size(), hd, ri, ci, offsets, ci_t, offsets_t, gather.to(torch.int32))
    o = stk.ops.dsd(h, w2c)
    y = torch.empty_like(x)
    y[order] = (o[dest] + b2[se]) * gates.reshape(-1)[order, None].to(x.dtype)
    return y


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).norm() / b.norm()).item())


def stk_subprocess(a: argparse.Namespace, E: int) -> list[dict]:
    """The stk rows of one case, timed in a child process; its failure becomes a row."""
    cmd = [sys.executable, __file__, "--stk-only", "--experts", str(E), "--tokens", str(a.tokens),
           "--hidden", str(a.hidden), "--ffn", str(a.ffn), "--repeats", str(a.repeats),
           "--seed", str(a.seed)]
    proc = None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception as e:  # crashed (e.g. an illegal address kills its CUDA context) or hung
        tail = proc.stderr.strip().splitlines() if proc is not None else []
        err = (tail[-1] if tail else f"{type(e).__name__}: {e}")[:160]
        return [{"E": E, "impl": STK, "dtype": "float16", "note": "", "error": err}]


STK = "stk block-sparse 128 (MegaBlocks-style)"


def run_case(timer: Timer, T: int, H: int, F: int, E: int, seed: int,
             a: argparse.Namespace | None = None) -> list[dict]:
    """Rows of one expert count; with ``a`` the stk peer runs in a subprocess, without it only
    the stk peer runs (the subprocess side)."""
    import torch
    from pitgen.ops.moe import moe_ffn, weight_bytes, flops

    torch.manual_seed(seed)
    dev = "cuda"
    x = torch.randn(T, H, device=dev, dtype=torch.float16)
    w1 = (torch.randn(E, H, F, device=dev) * H ** -0.5).half()
    w2 = (torch.randn(E, F, H, device=dev) * F ** -0.5).half()
    b1 = (torch.randn(E, F, device=dev) * 0.1).half()
    b2 = (torch.randn(E, H, device=dev) * 0.1).half()
    ids = torch.tensor(routing(T, E, seed), device=dev, dtype=torch.int64)
    gates = torch.rand(T, 1, device=dev) * 0.5 + 0.5
    wbytes = weight_bytes(E, H, F)
    floor_ms = wbytes / (FLOOR_TBPS * 1e12) * 1e3
    counts = torch.bincount(ids.reshape(-1), minlength=E).cpu().numpy()
    base = {"E": E, "T": T, "H": H, "F": F, "topk": 1, "gflop": flops(T, H, F) / 1e9,
            "weight_mb": wbytes / 1e6, "floor_ms": floor_ms, "max_tokens_per_expert": int(counts.max()),
            "empty_experts": int((counts == 0).sum())}
    ref = loop_peer(x, ids, gates, w1, w2, b1, b2)
    rows = []

    def add(name: str, fn, dtype: str = "float16", note: str = "", check=None) -> None:
        row = dict(base, impl=name, dtype=dtype, note=note)
        try:
            out = fn()
            row["rel_err_vs_loop"] = err = rel_err(out if check is None else check(out), ref)
            if not err < 5e-2:
                raise ValueError(f"wrong result (rel err {err:.2g} vs the loop)")
            row["ms"] = timer(fn)
            row["host_ms"] = host_ms(fn, 20)
        except Exception as e:  # a peer that fails is a row, not a crash
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append(row)
        print(name, E, row.get("ms"), row.get("rel_err_vs_loop"), row.get("error", ""),
              file=sys.stderr, flush=True)

    if a is None:
        w1c = w1.permute(1, 0, 2).reshape(H, E * F).contiguous()
        w2c = w2.reshape(E * F, H).contiguous()
        add(STK, lambda: stk_peer(x, ids, gates, w1c, w2c, b1, b2, E, F),
            note="topology built with one sync")
        return rows
    add("pitgen moe_ffn (check=False)",
        lambda: moe_ffn(x, ids, gates, w1, w2, b1, b2, activation="gelu", check=False))
    add("pitgen moe_ffn (check=True)",
        lambda: moe_ffn(x, ids, gates, w1, w2, b1, b2, activation="gelu", check=True),
        note="one host sync for the id/gate check")
    add("torch loop over experts", lambda: loop_peer(x, ids, gates, w1, w2, b1, b2))
    try:
        grouped_peer(x, ids, gates, w1, w2, b1, b2)
        add("torch._grouped_mm", lambda: grouped_peer(x, ids, gates, w1, w2, b1, b2))
    except Exception as e:  # fp16 not supported: run it in bf16 as PyTorch allows
        args = [t.bfloat16() for t in (x,)] + [ids, gates] + [t.bfloat16() for t in (w1, w2, b1, b2)]
        add("torch._grouped_mm", lambda: grouped_peer(*args), dtype="bfloat16",
            note=f"fp16 refused ({type(e).__name__}); run in bf16")
    rows += [dict(base, **r) for r in stk_subprocess(a, E)]
    gm = next((r.get("ms") for r in rows if r["impl"] == "torch._grouped_mm"), None)
    for r in rows:
        if "ms" in r:
            r["vs_floor"] = r["ms"] / floor_ms
            r["speedup_vs_grouped_mm"] = gm / r["ms"] if gm else None
            r["tflops"] = base["gflop"] / r["ms"]
    return rows


def table(rows: list[dict], device: str) -> str:
    lines = [f"# MoE expert layer ({device})", "",
             "fp16, T=4096 tokens, H=768, F=3072, top-1, Zipf-like routing (seeded), GELU (tanh), "
             "biases; routing/index build included in every time; CUDA events, L2 flushed, median. "
             "Floor = reading every expert's weights once at 3.0 TB/s.", "",
             "| E | impl | dtype | ms | vs _grouped_mm | × floor | TFLOP/s | host ms/call | rel err vs loop | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, d=3: "—" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['E']} | {r['impl']} | {r['dtype']} | failed | | | | | | {r['error']} |")
            continue
        lines.append(f"| {r['E']} | {r['impl']} | {r['dtype']} | {f(r['ms'])} | "
                     f"{f(r.get('speedup_vs_grouped_mm'), 2)}× | {f(r['vs_floor'], 2)} | "
                     f"{f(r['tflops'], 0)} | {f(r['host_ms'])} | {r['rel_err_vs_loop']:.1e} | {r['note']} |")
    lines.append("")
    for E in sorted({r["E"] for r in rows}):
        r = next(r for r in rows if r["E"] == E)
        lines.append(f"- E={E}: {r['gflop']:.1f} GFLOP, weights {r['weight_mb']:.0f} MB "
                     f"(floor {r['floor_ms']:.3f} ms), busiest expert {r['max_tokens_per_expert']} "
                     f"tokens, {r['empty_experts']} experts empty.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    import torch
    timer = Timer(a.repeats)
    if a.stk_only:
        rows = run_case(timer, a.tokens, a.hidden, a.ffn, int(a.experts), a.seed)
        print(json.dumps(rows))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    rows = []
    for E in (int(e) for e in a.experts.split(",")):
        rows += run_case(timer, a.tokens, a.hidden, a.ffn, E, a.seed, a)
        torch.cuda.empty_cache()
    (out / "moe_layer.md").write_text(table(rows, device))
    (out / "moe_layer.json").write_text(json.dumps({"device": device, "torch": torch.__version__,
                                              "rows": rows}, indent=1))
    print(table(rows, device))


if __name__ == "__main__":
    main()
