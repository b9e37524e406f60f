"""Sparse-training benchmark: one training step (forward + backward) of a linear layer, fp16.

Cases (batch 4096 tokens; 4096→4096 and the OPT-style fc2 3072→768):
  weight 32x1     weight sparsity 90% in 32x1 micro-tiles of [out, in], a new mask every step
  weight random   weight sparsity 90%, unstructured random elements, a new mask every step
  input relu      activation sparsity 90% (ReLU output), sparse_input_linear
Peers in the same run: the dense step (F.linear + autograd) and the masked dense step
(F.linear(x, W * M) + autograd). pitgen's step includes the index builds (every call).

Timing: scripts/bench.py's Timer (CUDA events, warm-up, L2 flushed, median). The floor of a step
is max(density × the dense step, bytes that must move / the measured copy rate). Writes
training.md and training.json to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import Timer, copy_bytes_per_ms, device_meta, host_ms  # noqa: E402
from pitgen.ops.linear import (WEIGHT_DX, WEIGHT_FORWARD, _gemm,  # noqa: E402
                             sparse_input_linear, sparse_weight_linear)
from pitgen.ops.sddmm import sddmm  # noqa: E402

SHAPES = [(4096, 4096, 4096), (4096, 3072, 768)]  # batch, in, out
MASKS_PER_CASE = 4  # distinct masks cycled so every step sees a new one


def weight_masks(kind: str, out_f: int, in_f: int, sparsity: float, gen) -> list:
    masks = []
    for _ in range(MASKS_PER_CASE):
        if kind == "32x1":
            g = torch.rand(out_f // 32, in_f, device="cuda", generator=gen) >= sparsity
            masks.append(g.repeat_interleave(32, 0))
        else:
            masks.append(torch.rand(out_f, in_f, device="cuda", generator=gen) >= sparsity)
    return masks


def step_bytes(batch: int, in_f: int, out_f: int, mask: bool) -> int:
    """fp16 bytes a step must move: forward reads x, W, writes y; backward reads dY (twice),
    W, x, writes dX and dW; plus the mask (read three times) for the weight cases."""
    elems = 3 * batch * in_f + 3 * in_f * out_f + 3 * batch * out_f
    return 2 * elems + (3 * in_f * out_f if mask else 0)


def breakdown(timer: Timer, x, w, dy, mask) -> list[tuple[str, float]]:
    """Device ms of each part of the weight-sparse step, with the dense alternative beside it."""
    w_eff = w.detach() * mask
    x, dy = x.detach(), dy.detach()
    dw = torch.empty_like(w_eff)
    dyt, xt = dy.t().contiguous(), x.t().contiguous()
    parts = [
        ("W ⊙ M", lambda: w.detach() * mask),
        ("xᵀ copy (forward's B, dW's K)", lambda: x.t().contiguous()),
        ("forward yᵀ = W_eff xᵀ, pitgen 32x1",
         lambda: _gemm(WEIGHT_FORWARD, "A", "float16", "32x1", w_eff, xt, mask)),
        ("forward, dense cuBLAS", lambda: F.linear(x, w_eff)),
        ("dX, pitgen 32x1 (rows + atomics)",
         lambda: _gemm(WEIGHT_DX, "B", "float16", "32x1", dy, w_eff, mask)),
        ("dX, pitgen auto", lambda: _gemm(WEIGHT_DX, "B", "float16", "auto", dy, w_eff, mask)),
        ("dX, dense cuBLAS (the default)", lambda: dy @ w_eff),
        ("dW, dYᵀ copy", lambda: dy.t().contiguous()),
        ("dW, SDDMM (32, 1) into dense", lambda: sddmm(dyt, xt, mask, tile=(32, 1), out=dw)),
        ("dW, dense cuBLAS ⊙ M", lambda: (dy.t() @ x) * mask),
    ]
    return [(name, timer(fn, repeats=5 if "atomics" in name else None)) for name, fn in parts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sparsity", type=float, default=0.9)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    timer = Timer(args.repeats)
    gen = torch.Generator(device="cuda").manual_seed(0)
    meta = device_meta()
    copy_rate = copy_bytes_per_ms(timer)
    rows = []
    for batch, in_f, out_f in SHAPES:
        w = torch.randn(out_f, in_f, device="cuda", dtype=torch.float16, generator=gen) * 0.02
        w.requires_grad_()
        b = torch.zeros(out_f, device="cuda", dtype=torch.float16, requires_grad=True)
        x = torch.randn(batch, in_f, device="cuda", dtype=torch.float16, generator=gen)
        dy = torch.randn(batch, out_f, device="cuda", dtype=torch.float16, generator=gen)
        h = torch.randn(batch, in_f, device="cuda", generator=gen)
        x_relu = torch.relu(h - torch.quantile(h[:1024].flatten(), args.sparsity)).half()
        x_relu.requires_grad_()
        x.requires_grad_()
        flops = 3 * 2 * batch * in_f * out_f

        def run(fn, xx):
            def step():
                xx.grad = w.grad = b.grad = None
                fn().backward(dy)
            return step

        dense_ms = timer(run(lambda: F.linear(x, w, b), x))
        cases = []
        for kind in ("32x1", "random"):
            masks = weight_masks(kind, out_f, in_f, args.sparsity, gen)
            it = [0]

            def next_mask():
                it[0] = (it[0] + 1) % len(masks)
                return masks[it[0]]
            cases.append((f"weight {kind}", masks, next_mask))
        for name, masks, next_mask in cases:
            density = float(torch.stack(masks).float().mean())
            pit = run(lambda: sparse_weight_linear(x, w, next_mask(), b), x)
            masked = run(lambda: F.linear(x, w * next_mask(), b), x)
            rows.append(dict(case=name, batch=batch, in_f=in_f, out_f=out_f, density=density,
                             pitgen_ms=timer(pit), dense_ms=dense_ms, masked_ms=timer(masked),
                             host_ms=host_ms(pit, 10),
                             floor_ms=max(density * dense_ms,
                                          step_bytes(batch, in_f, out_f, True) / copy_rate),
                             gflop=flops / 1e9))
        density = float((x_relu != 0).float().mean())
        pit = run(lambda: sparse_input_linear(x_relu, w, b), x_relu)
        pit()  # 'auto' plans on the first call (one small copy back), outside the timing
        relu_dense = run(lambda: F.linear(x_relu, w, b), x_relu)
        rows.append(dict(case="input relu", batch=batch, in_f=in_f, out_f=out_f, density=density,
                         pitgen_ms=timer(pit), dense_ms=timer(relu_dense), masked_ms=None,
                         host_ms=host_ms(pit, 10),
                         floor_ms=max((2 * density + 1) / 3 * dense_ms,
                                      step_bytes(batch, in_f, out_f, False) / copy_rate),
                         gflop=flops / 1e9))
    gen2 = torch.Generator(device="cuda").manual_seed(1)
    bx = torch.randn(4096, 4096, device="cuda", dtype=torch.float16, generator=gen2)
    bw = torch.randn(4096, 4096, device="cuda", dtype=torch.float16, generator=gen2)
    parts = {kind: breakdown(timer, bx, bw, bx, weight_masks(kind, 4096, 4096, args.sparsity, gen2)[0])
             for kind in ("32x1", "random")}
    for r in rows:
        r["vs_dense"] = r["dense_ms"] / r["pitgen_ms"]
        r["vs_masked"] = r["masked_ms"] / r["pitgen_ms"] if r["masked_ms"] else None
        r["floor_ratio"] = r["pitgen_ms"] / r["floor_ms"]
    head = ["case", "batch×in→out", "density", "pitgen ms", "dense ms", "masked dense ms",
            "speed-up vs dense", "vs masked dense", "floor ms", "pitgen / floor", "host ms/step"]
    lines = [f"# Sparse training step (fp16, forward + backward), {meta['device']}", "",
             f"torch {meta['torch']}, CUDA {meta['cuda']}; median of {args.repeats} runs, L2 "
             "flushed; a new mask every step (index builds included). Floor: max(density × "
             "dense step [input relu: (2d+1)/3, dX stays dense], bytes / copy rate "
             f"{copy_rate / 1e6:.2f} TB/s).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        vm = f"{r['vs_masked']:.2f}×" if r["vs_masked"] else "—"
        mm = f"{r['masked_ms']:.3f}" if r["masked_ms"] else "—"
        lines.append(f"| {r['case']} | {r['batch']}×{r['in_f']}→{r['out_f']} | {r['density']:.3f} "
                     f"| {r['pitgen_ms']:.3f} | {r['dense_ms']:.3f} | {mm} | {r['vs_dense']:.2f}× "
                     f"| {vm} | {r['floor_ms']:.3f} | {r['floor_ratio']:.1f}× | {r['host_ms']:.3f} |")
    lines += ["", "Parts of the weight-sparse step, 4096×4096→4096 (device ms, median):", "",
              "| part | 32x1 mask | random mask |", "|---|---|---|"]
    for (name, a), (_, b) in zip(parts["32x1"], parts["random"]):
        lines.append(f"| {name} | {a:.3f} | {b:.3f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "training.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump({"meta": meta, "copy_bytes_per_ms": copy_rate, "rows": rows,
                   "parts_ms": {k: dict(v) for k, v in parts.items()}}, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
