"""The MoE expert layer (``pitgen bench moe``): pitgen's fused layer (GPU routing index + two
grouped tensor-core GEMMs) against a PyTorch loop over experts, torch._grouped_mm and stk
block-sparse (MegaBlocks style), routing included in every time.

Workload: T=4096 tokens, H=768, F=3072, top-1 and top-2, skewed (Zipf-like, seeded) expert
popularity, GELU and biases, E = 8, 64 and 128, fp16. Floor: reading every expert's weights once
at the copy rate measured in the run, or the FLOPs at the dense fp16 matmul rate measured there,
whichever is longer (E = 8 is compute-bound). The stk peer runs in a child process (``--stk-only``): a fault in its
kernels kills a CUDA context, and must not take the other rows with it. Writes moe_layer.md and
moe_layer.json (moe.md is the peer suite's Switch-base workload).

Training: the same cases' step (forward and every gradient: x, gates, w1, w2, b1, b2) for
pitgen in fp16 and bf16 and for the ``_grouped_mm`` layer in bf16 through torch's autograd,
each checked against float32 autograd of the loop over experts; floor: the step's six GEMMs
(2 forward, 4 backward) at the measured matmul rate, or the weights read three times and their
gradients written once at the copy rate. Writes moe_training.md and moe_training.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .report import describe, fmt, fmt_e, fmt_x, md_table, ratio, rel_err, write_json
from .timing import Timer

if TYPE_CHECKING:
    from .suite import Run

T, H, F = 4096, 768, 3072
SEED = 0
STK = "stk block-sparse 128 (MegaBlocks-style)"
#: relative error against the loop above which a result is refused (and not timed)
TOL = 5e-2


def routing(tokens: int, experts: int, seed: int, topk: int = 1) -> np.ndarray:
    """Expert ids [tokens, topk] with Zipf-like popularity (p_e ~ 1/(e+1)^1.1, experts
    shuffled); top-k > 1: k distinct experts per token (Gumbel top-k over the same weights)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, experts + 1) ** 1.1
    perm = rng.permutation(experts)
    if topk == 1:
        return perm[rng.choice(experts, size=(tokens, 1), p=p / p.sum())]
    scores = np.log(p / p.sum()) + rng.gumbel(size=(tokens, experts))
    return perm[np.argsort(-scores, axis=1)[:, :topk]]


def loop_peer(x, ids, gates, w1, w2, b1, b2):
    """PyTorch loop over experts: the (token, j) pairs of each expert found by sorting (one sync
    for the counts), index_select, two matmuls, index_add with the gate."""
    import torch
    import torch.nn.functional as F
    topk = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    y = torch.zeros_like(x)
    start = 0
    for e, c in enumerate(counts):
        if c:
            pairs = order[start:start + c]
            tokens = pairs // topk
            h = F.gelu(torch.index_select(x, 0, tokens) @ w1[e] + b1[e], approximate="tanh")
            o = (h @ w2[e] + b2[e]) * gates.reshape(-1)[pairs, None].to(x.dtype)
            y.index_add_(0, tokens, o)
        start += c
    return y


def grouped_peer(x, ids, gates, w1, w2, b1, b2):
    """torch._grouped_mm: sort the (token, j) pairs by expert (GPU, no sync), offs = int32
    cumulative row ends, two grouped GEMMs, scatter back with the gate (top-1: a direct store;
    top-k: index_add over the tokens)."""
    import torch
    import torch.nn.functional as F
    E, topk = w1.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    se = flat[order]
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    tokens = order // topk if topk > 1 else order
    xs = x[tokens]
    h = torch._grouped_mm(xs, w1, offs=offs) + b1[se]
    h = F.gelu(h, approximate="tanh")
    o = (torch._grouped_mm(h, w2, offs=offs) + b2[se]) * gates.reshape(-1)[order, None].to(x.dtype)
    if topk == 1:
        y = torch.empty_like(x)
        y[order] = o
    else:
        y = torch.zeros_like(x).index_add_(0, tokens, o)
    return y


def stk_dmoe(x, flat_ids, w1c, w2c, E, F_, act, blk=128):
    """MegaBlocks' dMoE on stk for top-1 routing (pair i is token i): tokens sorted and padded
    per expert to blk-row blocks, a block-diagonal topology [padded tokens, E*F] built on the GPU
    (the padded count comes to the host: one sync, as in MegaBlocks), sdd for W1, ``act(blocks,
    block columns)`` on the intermediate's blocks, dsd for W2. Returns (o, order): o[i] is
    token order[i]'s output row.

    The block indices are int32, not stk's usual int16: its sdd kernel computes
    ``column index * BLOCK_N``, which Triton 3 keeps in the index's type, so an int16 index past
    255 block columns (E * F > 32K: E 64 at F 3072) wraps and reads out of bounds (NaN or an
    illegal address)."""
    import torch
    import stk
    dev = x.device
    counts = torch.bincount(flat_ids, minlength=E)
    padded = (counts + blk - 1) // blk * blk
    pstart = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    rows_total = int(padded.sum())
    order = torch.argsort(flat_ids)
    se = flat_ids[order]
    dest = pstart[se] + torch.arange(flat_ids.numel(), device=dev) - start[se]
    xp = x.new_zeros(rows_total, x.shape[1])
    xp[dest] = x[order]
    nrows, fb = rows_total // blk, F_ // blk
    row_expert = torch.repeat_interleave(torch.arange(E, device=dev), padded // blk,
                                         output_size=nrows)
    cols = (row_expert[:, None] * fb + torch.arange(fb, device=dev)).reshape(-1).int()
    rows = torch.arange(nrows, device=dev, dtype=torch.int32).repeat_interleave(fb)
    offsets = torch.arange(nrows + 1, device=dev, dtype=torch.int32) * fb
    gather = torch.argsort(cols, stable=True)
    meta = (rows, cols, offsets, rows.gather(0, gather),
            torch.cat([offsets.new_zeros(1),
                       torch.cumsum(torch.bincount(cols, minlength=E * fb), 0).int()]),
            gather.int())
    data = torch.empty(nrows * fb, blk, blk, dtype=x.dtype, device=dev)
    h = stk.ops.sdd(xp, w1c, stk.Matrix((rows_total, E * F_), data, *meta))
    h = stk.Matrix((rows_total, E * F_), act(h.data.view(-1, blk, blk), cols), *meta)
    return stk.ops.dsd(h, w2c)[dest], order


def stk_peer(x, ids, gates, w1c, w2c, b1, b2, E, F_, blk=128):
    """The layer on stk (:func:`stk_dmoe`): bias and GELU on the intermediate's blocks, then
    the second bias and the gate per token (top-1)."""
    import torch.nn.functional as Fn
    flat = ids.reshape(-1)
    bias = b1.reshape(-1, blk)  # per block column

    def act(blocks, cols):
        return Fn.gelu(blocks + bias[cols.long()][:, None, :], approximate="tanh")

    o, order = stk_dmoe(x, flat, w1c, w2c, E, F_, act, blk)
    y = x.new_empty(x.shape)
    y[order] = (o + b2[flat[order]]) * gates.reshape(-1)[order, None].to(x.dtype)
    return y


def _measured(row: dict, timer: Timer, fn: Callable[[], Any], error: Callable[[Any], float],
              what: str) -> dict:
    """``row`` with the relative error of ``fn``'s result against the loop (``error``) and, when
    below TOL, its device and eager host times; a failure is the row's error, not a crash."""
    try:
        row["rel_err_vs_loop"] = err = error(fn())
        if not err < TOL:
            raise ValueError(f"wrong {what} (rel err {err:.2g} vs the loop)")
        t = timer.both(fn)
        row["ms"], row["host_ms"] = t.gpu_ms, t.wall_ms
    except Exception as e:  # a peer that fails is a row, not a crash
        row["error"] = describe(e)
    return row


class _Case:
    """One expert count's inputs, the loop's output as reference, and the rows measured."""

    def __init__(self, timer: Timer, experts: int, topk: int = 1):
        import torch

        from pitgen.ops.moe import flops, weight_bytes

        torch.manual_seed(SEED)
        E, dev = experts, "cuda"
        self.timer, self.rows = timer, []
        self.x = torch.randn(T, H, device=dev, dtype=torch.float16)
        self.w1 = (torch.randn(E, H, F, device=dev) * H ** -0.5).half()
        self.w2 = (torch.randn(E, F, H, device=dev) * F ** -0.5).half()
        self.b1 = (torch.randn(E, F, device=dev) * 0.1).half()
        self.b2 = (torch.randn(E, H, device=dev) * 0.1).half()
        self.ids = torch.tensor(routing(T, E, SEED, topk), device=dev, dtype=torch.int64)
        self.gates = torch.rand(T, topk, device=dev) * 0.5 + 0.5
        counts = torch.bincount(self.ids.reshape(-1), minlength=E).cpu().numpy()
        self.base = {"E": E, "T": T, "H": H, "F": F, "topk": topk,
                     "gflop": flops(T * topk, H, F) / 1e9,
                     "weight_mb": weight_bytes(E, H, F) / 1e6,
                     "max_tokens_per_expert": int(counts.max()),
                     "empty_experts": int((counts == 0).sum())}
        self.ref = loop_peer(*self.args())

    def args(self) -> tuple:
        return self.x, self.ids, self.gates, self.w1, self.w2, self.b1, self.b2

    def add(self, name: str, fn: Callable[[], Any], dtype: str = "float16", note: str = "") -> None:
        """One system's row: checked against the loop, then timed (device and eager host)."""
        row = _measured(dict(self.base, impl=name, dtype=dtype, note=note), self.timer, fn,
                        lambda y: rel_err(y, self.ref), "result")
        self.rows.append(row)
        print(name, self.base["E"], self.base["topk"], row.get("ms"), row.get("rel_err_vs_loop"),
              row.get("error", ""), file=sys.stderr, flush=True)

    def stk(self) -> None:
        E = self.base["E"]
        w1c = self.w1.permute(1, 0, 2).reshape(H, E * F).contiguous()
        w2c = self.w2.reshape(E * F, H).contiguous()
        self.add(STK, lambda: stk_peer(*self.args()[:3], w1c, w2c, self.b1, self.b2, E, F),
                 note="topology built with one sync")


def stk_only(timer: Timer, args: argparse.Namespace) -> int:
    """The child side: the stk rows of one expert count, as JSON on stdout's last line."""
    case = _Case(timer, int(args.experts[0]))
    case.stk()
    print(json.dumps(case.rows))
    return 0


def _stk_child(experts: int, repeats: int) -> list[dict]:
    """The stk rows of one case, timed in a child process; its failure becomes a row."""
    cmd = [sys.executable, "-m", "pitgen.bench", "moe", "--stk-only", "--experts", str(experts),
           "--repeats", str(repeats)]
    proc = None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception as e:  # crashed (e.g. an illegal address kills its CUDA context) or hung
        tail = proc.stderr.strip().splitlines() if proc is not None else []
        err = (tail[-1] if tail else f"{type(e).__name__}: {e}")[:160]
        return [{"E": experts, "impl": STK, "dtype": "float16", "note": "", "error": err}]


def _rows(r: Run, experts: int, topk: int) -> list[dict]:
    """Every system's row at one expert count and top-k (stk's from a child process, top-1)."""
    from pitgen.ops.moe import moe_ffn

    case = _Case(r.timer, experts, topk)
    x, ids, gates, w1, w2, b1, b2 = case.args()
    case.add("pitgen moe_ffn (check=False)",
             lambda: moe_ffn(x, ids, gates, w1, w2, b1, b2, activation="gelu", check=False))
    case.add("pitgen moe_ffn (check=True)",
             lambda: moe_ffn(x, ids, gates, w1, w2, b1, b2, activation="gelu", check=True),
             note="one host sync for the id/gate check")
    case.add("torch loop over experts", lambda: loop_peer(*case.args()))
    # The peer in its fastest configuration: bf16 (torch's fp16 _grouped_mm is a slow fallback
    # where it runs at all); fp16 beside it when torch takes it. Ratios use the faster row.
    bf = (x.bfloat16(), ids, gates, *(t.bfloat16() for t in (w1, w2, b1, b2)))
    case.add("torch._grouped_mm", lambda: grouped_peer(*bf), dtype="bfloat16")
    try:
        grouped_peer(*case.args())
        case.add("torch._grouped_mm", lambda: grouped_peer(*case.args()))
    except Exception as e:  # fp16 not supported by this torch
        case.rows.append(dict(case.base, impl="torch._grouped_mm", dtype="float16", note="",
                              error=f"fp16 refused ({type(e).__name__})"))
    floor_ms = max(r.ceilings.copy_ms(case.base["weight_mb"] * 1e6),
                   case.base["gflop"] / r.ceilings.matmul_tflops["float16"])
    stk = [] if topk > 1 else [dict(case.base, **x) for x in _stk_child(experts, r.timer.repeats)]
    return [dict(row, floor_ms=floor_ms) for row in case.rows + stk]


def _training_rows(r: Run, experts: int, topk: int) -> list[dict]:
    """One case's training steps: pitgen fp16 and bf16 and the bf16 ``_grouped_mm`` layer,
    each step's gradients checked against float32 autograd of the loop over experts."""
    import torch

    from pitgen.ops.moe import moe_ffn

    case = _Case(r.timer, experts, topk)
    dy = torch.randn_like(case.x)
    ids = case.ids
    f32 = [t.float().requires_grad_() for t in (case.x, case.gates, case.w1, case.w2, case.b1,
                                                 case.b2)]
    x, g, w1, w2, b1, b2 = f32
    want = torch.autograd.grad(loop_peer(x, ids, g, w1, w2, b1, b2), f32, dy.float())
    rows = []

    def add(name: str, dtype: Any, layer: Callable[..., Any]) -> None:
        leaves = [(t.detach().clone() if t is case.gates else t.detach().to(dtype))
                  .requires_grad_()   # gates stay float32, as the router gives them
                  for t in (case.x, case.gates, case.w1, case.w2, case.b1, case.b2)]
        d = dy.to(dtype)

        def step() -> Any:
            return torch.autograd.grad(layer(*leaves[:1], ids, *leaves[1:]), leaves, d)
        row = _measured(dict(case.base, impl=name, dtype=str(dtype).replace("torch.", "")),
                        r.timer, step,
                        lambda grads: max(rel_err(g, w) for g, w in zip(grads, want)), "gradients")
        rows.append(row)
        print("training", name, experts, topk, row.get("ms"), row.get("error", ""),
              file=sys.stderr, flush=True)

    def pitgen_layer(x, ids, g, w1, w2, b1, b2):
        return moe_ffn(x, ids, g, w1, w2, b1, b2, activation="gelu", check=False)
    add("pitgen moe_ffn (check=False)", torch.float16, pitgen_layer)
    add("pitgen moe_ffn (check=False)", torch.bfloat16, pitgen_layer)
    add("torch._grouped_mm", torch.bfloat16, grouped_peer)
    floor_ms = max(3 * case.base["gflop"] / r.ceilings.matmul_tflops["float16"],
                   r.ceilings.copy_ms(4 * case.base["weight_mb"] * 1e6))
    return [dict(row, floor_ms=floor_ms) for row in rows]


def _speedups(rows: list[dict]) -> None:
    """Each timed row's time over its floor and the faster ``_grouped_mm`` row's speed-up."""
    for row in rows:
        gm = min((x["ms"] for x in rows if x["impl"] == "torch._grouped_mm"
                  and (x["E"], x["topk"]) == (row["E"], row["topk"]) and "ms" in x),
                 default=None)
        if "ms" in row:
            row["vs_floor"] = row["ms"] / row["floor_ms"]
            row["speedup_vs_grouped_mm"] = ratio(gm, row["ms"])


def run(r: Run) -> int:
    import torch

    rows, steps = [], []
    for topk in [1] if r.args.quick else [1, 2]:
        for experts in r.args.experts or ([64] if r.args.quick else [8, 64, 128]):
            rows += _rows(r, int(experts), topk)
            torch.cuda.empty_cache()
            steps += _training_rows(r, int(experts), topk)
            torch.cuda.empty_cache()
    _speedups(steps)
    write_json(r.out / "moe_training.json", {"meta": r.meta, "rows": steps})
    (r.out / "moe_training.md").write_text(training_table(steps, r.meta))
    _speedups(rows)
    for row in rows:
        if "ms" in row:
            row["tflops"] = row["gflop"] / row["ms"]
    write_json(r.out / "moe_layer.json", {"meta": r.meta, "rows": rows})
    text = table(rows, r.meta, r.ceilings.copy_bytes_per_ms)
    (r.out / "moe_layer.md").write_text(text)
    print(text)
    print(training_table(steps, r.meta))
    return 1 if any(row["impl"].startswith("pitgen") and "error" in row
                    for row in rows + steps) else 0


def training_table(rows: list[dict], meta: dict) -> str:
    lines = [f"# MoE expert layer, training step ({meta['device']})", "",
             f"T={T} tokens, H={H}, F={F}, Zipf-like routing (seeded), GELU (tanh), biases; one "
             "step = the forward and the gradients of x, gates, w1, w2, b1 and b2 "
             "(`torch.autograd.grad`), routing included; CUDA events, L2 flushed, median of "
             f"{meta['repeats']}; host ms is the eager wall time per step. Floor = the step's six "
             "GEMMs at the measured dense fp16 matmul rate, or the weights read three times and "
             "their gradients written once at the measured copy rate, whichever is longer. "
             "`vs _grouped_mm`: against the bf16 `_grouped_mm` layer through torch's autograd "
             "(its fast path). rel err: the largest over the six gradients, against float32 "
             "autograd of the loop over experts.", ""]
    lines += md_table(
        ["E", "top-k", "impl", "dtype", "step ms", "vs _grouped_mm", "× floor", "host ms/step",
         "rel err vs loop"],
        [[x["E"], x["topk"], x["impl"], x["dtype"], "failed", "", "", "", x["error"]]
         if "error" in x
         else [x["E"], x["topk"], x["impl"], x["dtype"], fmt(x["ms"]),
               fmt_x(x["speedup_vs_grouped_mm"]), fmt(x["vs_floor"], 2), fmt(x["host_ms"]),
               fmt_e(x["rel_err_vs_loop"])] for x in rows])
    return "\n".join(lines) + "\n"


def table(rows: list[dict], meta: dict, copy_rate: float) -> str:
    lines = [f"# MoE expert layer ({meta['device']})", "",
             f"fp16, T={T} tokens, H={H}, F={F}, Zipf-like routing (seeded), GELU (tanh), "
             "biases; routing/index build included in every time; CUDA events, L2 flushed, "
             f"median of {meta['repeats']}; host ms is eager wall time per call. Floor = reading "
             f"every expert's weights once at the measured copy rate "
             f"({copy_rate / 1e9:.2f} TB/s) or the FLOPs at the measured dense fp16 matmul rate, "
             "whichever is longer. `vs _grouped_mm`: against the faster `_grouped_mm` row of "
             "the same case (bf16 is its fast path).", ""]
    lines += md_table(
        ["E", "top-k", "impl", "dtype", "ms", "vs _grouped_mm", "× floor", "TFLOP/s",
         "host ms/call", "rel err vs loop", "note"],
        [[x["E"], x["topk"], x["impl"], x["dtype"], "failed", "", "", "", "", "", x["error"]]
         if "error" in x
         else [x["E"], x["topk"], x["impl"], x["dtype"], fmt(x["ms"]),
               fmt_x(x["speedup_vs_grouped_mm"]), fmt(x["vs_floor"], 2), fmt(x["tflops"], 0),
               fmt(x["host_ms"]), fmt_e(x["rel_err_vs_loop"]), x["note"]] for x in rows])
    lines.append("")
    for case in sorted({(x["E"], x["topk"]) for x in rows}):
        x = next(x for x in rows if (x["E"], x["topk"]) == case)
        lines.append(f"- E={case[0]}, top-{case[1]}: {x['gflop']:.1f} GFLOP, weights "
                     f"{x['weight_mb']:.0f} MB (floor {x['floor_ms']:.3f} ms), busiest expert "
                     f"{x['max_tokens_per_expert']} pairs, {x['empty_experts']} experts empty.")
    return "\n".join(lines) + "\n"
