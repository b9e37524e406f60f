"""Sparse training (``pitgen bench training``): one step (forward + backward) of a linear
layer, fp16, batch 4096 tokens, 4096->4096 and the OPT-style fc2 3072->768:

- weight 32x1: weight sparsity 90% in 32x1 micro-tiles of [out, in], a new mask every step;
- weight random: 90% unstructured random elements, a new mask every step;
- input relu: activation sparsity 90% (a ReLU's output), ``sparse_input_linear``.

Peers in the same run: the dense step (F.linear + autograd) and the masked dense step
(F.linear(x, W * M) + autograd). pitgen's step includes its index builds (every call). The floor
of a step is max(density x the dense step, bytes that must move / the measured copy rate).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .report import fmt, fmt_x, md_table, ratio, write_json

if TYPE_CHECKING:
    from .suite import Run
    from .timing import Timer

SHAPES = [(4096, 4096, 4096), (4096, 3072, 768)]  # batch, in, out
SPARSITY = 0.9
MASKS_PER_CASE = 4  # distinct masks cycled so every step sees a new one
PARTS_N = 4096  # the step timed part by part: N x N -> N


def step_bytes(batch: int, in_f: int, out_f: int, mask: bool) -> int:
    """fp16 bytes a step must move: forward reads x, W, writes y; backward reads dY (twice),
    W, x, writes dX and dW; plus the mask (read three times) for the weight cases."""
    elems = 3 * batch * in_f + 3 * in_f * out_f + 3 * batch * out_f
    return 2 * elems + (3 * in_f * out_f if mask else 0)


def weight_masks(kind: str, out_f: int, in_f: int, gen: Any) -> list:
    """MASKS_PER_CASE masks of [out, in] at SPARSITY, in 32x1 tiles or element by element."""
    from .workloads import block_mask

    unit = (32, 1) if kind == "32x1" else (1, 1)
    return [block_mask((out_f, in_f), unit, 1 - SPARSITY, gen) for _ in range(MASKS_PER_CASE)]


def breakdown(timer: Timer, x: Any, w: Any, dy: Any, mask: Any) -> list[tuple[str, float]]:
    """Device ms of each part of the weight-sparse step, with the dense alternative beside it."""
    import torch.nn.functional as F

    from pitgen.ops.linear import WEIGHT_DX, WEIGHT_FORWARD, _gemm
    from pitgen.ops.sddmm import sddmm

    w_eff = w * mask
    dw = w_eff.new_empty(w_eff.shape)
    dyt, xt = dy.t().contiguous(), x.t().contiguous()
    parts = [
        ("W ⊙ M", lambda: w * mask),
        ("xᵀ copy (forward's B, dW's K)", lambda: x.t().contiguous()),
        ("forward yᵀ = W_eff xᵀ, pitgen 32x1",
         lambda: _gemm(WEIGHT_FORWARD, "A", "float16", "32x1", w_eff, xt, mask)),
        ("forward, dense cuBLAS", lambda: F.linear(x, w_eff)),
        ("dX, pitgen 32x1 (row-owner)",
         lambda: _gemm(WEIGHT_DX, "B", "float16", "32x1", dy, w_eff, mask)),
        ("dX, pitgen auto", lambda: _gemm(WEIGHT_DX, "B", "float16", "auto", dy, w_eff, mask)),
        ("dX, dense cuBLAS (the default)", lambda: dy @ w_eff),
        ("dW, dYᵀ copy", lambda: dy.t().contiguous()),
        ("dW, SDDMM (32, 1) into dense", lambda: sddmm(dyt, xt, mask, tile=(32, 1), out=dw)),
        ("dW, dense cuBLAS ⊙ M", lambda: (dy.t() @ x) * mask),
    ]
    return [(name, timer(fn, repeats=5 if "row-owner" in name else None)) for name, fn in parts]


def _shape_rows(r: Run, batch: int, in_f: int, out_f: int, gen: Any) -> list[dict]:
    """The three cases of one layer shape."""
    import torch
    import torch.nn.functional as F

    from pitgen.ops.linear import sparse_input_linear, sparse_weight_linear

    timer = r.timer
    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.float16, generator=gen) * 0.02
    w.requires_grad_()
    b = torch.zeros(out_f, device="cuda", dtype=torch.float16, requires_grad=True)
    x = torch.randn(batch, in_f, device="cuda", dtype=torch.float16, generator=gen)
    dy = torch.randn(batch, out_f, device="cuda", dtype=torch.float16, generator=gen)
    h = torch.randn(batch, in_f, device="cuda", generator=gen)
    x_relu = torch.relu(h - torch.quantile(h[:1024].flatten(), SPARSITY)).half()
    x_relu.requires_grad_()
    x.requires_grad_()
    base = {"batch": batch, "in_f": in_f, "out_f": out_f,
            "gflop": 3 * 2 * batch * in_f * out_f / 1e9}

    def step(forward: Callable[..., Any], xx: Any) -> Callable[..., None]:
        """forward(*inputs) then backward(dy), gradients cleared first."""
        def go(*inputs: Any) -> None:
            xx.grad = w.grad = b.grad = None
            forward(*inputs).backward(dy)
        return go

    dense_ms = timer(step(lambda: F.linear(x, w, b), x))
    rows = []
    for kind in ("32x1", "random"):
        masks = [(m,) for m in weight_masks(kind, out_f, in_f, gen)]
        density = float(torch.stack([m for m, in masks]).float().mean())
        pit = timer.both(step(lambda m: sparse_weight_linear(x, w, m, b), x), inputs=masks,
                         calls=10)
        rows.append({"case": f"weight {kind}", **base, "density": density,
                     "pitgen_ms": pit.gpu_ms, "host_ms": pit.wall_ms, "dense_ms": dense_ms,
                     "masked_ms": timer(step(lambda m: F.linear(x, w * m, b), x), inputs=masks),
                     "floor_ms": max(density * dense_ms, r.ceilings.copy_ms(
                         step_bytes(batch, in_f, out_f, True)))})
    density = float((x_relu != 0).float().mean())
    pit = timer.both(step(lambda: sparse_input_linear(x_relu, w, b), x_relu), calls=10)
    rows.append({"case": "input relu", **base, "density": density, "pitgen_ms": pit.gpu_ms,
                 "host_ms": pit.wall_ms,
                 "dense_ms": timer(step(lambda: F.linear(x_relu, w, b), x_relu)),
                 "masked_ms": None,
                 "floor_ms": max((2 * density + 1) / 3 * dense_ms,  # dX stays dense
                                 r.ceilings.copy_ms(step_bytes(batch, in_f, out_f, False)))})
    return rows


def run(r: Run) -> int:
    import torch

    from .report import Progress

    shapes = SHAPES[:1] if r.args.quick else SHAPES
    progress = Progress(len(shapes) + 1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch, in_f, out_f in shapes:
        progress.step(f"training {batch}x{in_f}->{out_f}")
        rows += _shape_rows(r, batch, in_f, out_f, gen)
    progress.step("training: parts of the weight-sparse step")
    gen2 = torch.Generator(device="cuda").manual_seed(1)
    n = PARTS_N
    bx, bw = (torch.randn(n, n, device="cuda", dtype=torch.float16, generator=gen2)
              for _ in range(2))
    parts = {kind: breakdown(r.timer, bx, bw, bx, weight_masks(kind, n, n, gen2)[0])
             for kind in ("32x1", "random")}
    for x in rows:
        x["vs_dense"] = x["dense_ms"] / x["pitgen_ms"]
        x["vs_masked"] = ratio(x["masked_ms"], x["pitgen_ms"])
        x["floor_ratio"] = x["pitgen_ms"] / x["floor_ms"]
    write_json(r.out / "training.json", {"meta": r.meta, "rows": rows,
                                         "parts_ms": {k: dict(v) for k, v in parts.items()}})
    lines = [f"# Sparse training step (fp16, forward + backward), {r.meta['device']}", "",
             f"torch {r.meta['torch']}, CUDA {r.meta['cuda']}; median of {r.timer.repeats} runs, "
             "L2 flushed; a new mask every step (index builds included); host ms is the eager "
             "wall time of a step. Floor: max(density × dense step [input relu: (2d+1)/3, dX "
             f"stays dense], bytes / copy rate {r.ceilings.copy_bytes_per_ms / 1e9:.2f} TB/s).",
             ""]
    lines += md_table(
        ["case", "batch×in→out", "density", "pitgen ms", "dense ms", "masked dense ms",
         "speed-up vs dense", "vs masked dense", "floor ms", "pitgen / floor", "host ms/step"],
        [[x["case"], f"{x['batch']}×{x['in_f']}→{x['out_f']}", fmt(x["density"]),
          fmt(x["pitgen_ms"]), fmt(x["dense_ms"]), fmt(x["masked_ms"]), fmt_x(x["vs_dense"]),
          fmt_x(x["vs_masked"]), fmt(x["floor_ms"]), fmt_x(x["floor_ratio"]),
          fmt(x["host_ms"])] for x in rows])
    lines += ["", f"Parts of the weight-sparse step, {n}×{n}→{n} (device ms, median):", ""]
    lines += md_table(["part", "32x1 mask", "random mask"],
                      [[name, fmt(a), fmt(b)]
                       for (name, a), (_, b) in zip(parts["32x1"], parts["random"])])
    text = "\n".join(lines) + "\n"
    (r.out / "training.md").write_text(text)
    print(text)
    return 0
