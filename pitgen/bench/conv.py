"""Sparse-channel convolution (``pitgen bench conv``): ResNet-50 stage shapes (N = 32, fp16) whose
input has 0%, 50% or 90% of its channels zero, as ReLU activations have, the zero channels new
every call (three inputs rotate), pitgen against cuDNN in the same run.

Systems:
- ``pitgen``: :func:`pitgen.ops.conv.sparse_conv2d` (index + gather + implicit GEMM) on NCHW and
  on channels_last X, the faster reported; its index alone (:func:`channel_index`) beside it;
- ``cuDNN``: ``torch.nn.functional.conv2d`` on NCHW and on channels_last X, the faster reported;
- ``auto``: :class:`pitgen.nn.SparseConv2d` (mode "auto") on X in cuDNN's faster format, in its
  steady state (its density read back from earlier calls): the 0% target is auto within 5% of
  cuDNN.

Floors: the active channels' FLOPs at cuDNN's dense rate (the density times cuDNN's time) and
reading X once at the copy rate measured at the start of the run; the floor is the larger.
Every pitgen result is checked against cuDNN in float32 on the same input.
Writes conv.md and conv.json.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .report import fmt, fmt_x, geomean, md_table, rel_err, write_json

if TYPE_CHECKING:
    from .suite import Run

#: (name, X [N, C, H, W], W [F, C, R, S], padding): ResNet-50's stage shapes at batch 32
SHAPES = (
    ("56x56 3x3", (32, 256, 56, 56), (64, 256, 3, 3), 1),
    ("56x56 1x1", (32, 256, 56, 56), (64, 256, 1, 1), 0),
    ("28x28 3x3", (32, 512, 28, 28), (128, 512, 3, 3), 1),
    ("28x28 1x1", (32, 512, 28, 28), (128, 512, 1, 1), 0),
    ("14x14 3x3", (32, 1024, 14, 14), (256, 1024, 3, 3), 1),
    ("14x14 1x1", (32, 1024, 14, 14), (256, 1024, 1, 1), 0),
)
QUICK = ("56x56 3x3", "14x14 1x1")
SPARSITIES = (0.0, 0.5, 0.9)
DTYPE = "float16"
TOL = 1e-2
#: pitgen / cuDNN at 90% sparsity, and auto / cuDNN at 0%
TARGET_90, TARGET_AUTO_0 = 0.35, 1.05
ROTATE = 3


def activations(shape: tuple[int, ...], sparsity: float, seed: int) -> Any:
    """ReLU(N(0, 1)) X with ``sparsity`` of its channels zero in every sample (fp16, NCHW)."""
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.relu(torch.randn(shape, device="cuda", generator=gen, dtype=torch.float16))
    dead = torch.randperm(shape[1], device="cuda", generator=gen)[:int(round(sparsity * shape[1]))]
    x[:, dead] = 0
    return x


def run_case(r: Run, name: str, xs_shape: tuple, w_shape: tuple, pad: int,
             sparsity: float) -> dict:
    import torch
    import torch.nn.functional as F

    import pitgen.nn
    from pitgen.ops.conv import channel_index, sparse_conv2d

    gen = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(w_shape, device="cuda", generator=gen) / (w_shape[1] * w_shape[2] * w_shape[3]) ** 0.5).half()
    nchw = [activations(xs_shape, sparsity, seed) for seed in range(ROTATE)]
    nhwc = [x.contiguous(memory_format=torch.channels_last) for x in nchw]
    formats = {"nchw": [(x,) for x in nchw], "channels_last": [(x,) for x in nhwc]}
    ref = F.conv2d(nchw[0].float(), w.float(), padding=pad)
    case: dict = {"shape": name, "x": list(xs_shape), "weight": list(w_shape), "padding": pad,
                  "sparsity": sparsity, "dtype": DTYPE,
                  "density": int(channel_index(nchw[0])[1].item()) / xs_shape[1]}
    cudnn, pit, index = {}, {}, {}
    for fmt_name, inputs in formats.items():
        t = r.timer.both(lambda x: F.conv2d(x, w, padding=pad), inputs=inputs)
        cudnn[fmt_name] = {"gpu_ms": t.gpu_ms, "wall_ms": t.wall_ms}
        y = sparse_conv2d(inputs[0][0], w, padding=pad)
        t = r.timer.both(lambda x: sparse_conv2d(x, w, padding=pad), inputs=inputs)
        pit[fmt_name] = {"gpu_ms": t.gpu_ms, "wall_ms": t.wall_ms, "rel_err": rel_err(y, ref)}
        index[fmt_name] = r.timer(lambda x: channel_index(x), inputs=inputs)
    best_c = min(cudnn, key=lambda k: cudnn[k]["gpu_ms"])
    best_p = min(pit, key=lambda k: pit[k]["gpu_ms"])
    auto = pitgen.nn.SparseConv2d(w_shape[1], w_shape[0], w_shape[2], padding=pad, bias=False,
                                  device="cuda", dtype=torch.float16)
    with torch.no_grad():
        auto.weight.copy_(w)
        for x, in formats[best_c] * 2:   # steady state: the density of earlier calls known
            auto(x)
            torch.cuda.synchronize()
        y = auto(formats[best_c][0][0])
        t = r.timer.both(lambda x: auto(x), inputs=formats[best_c])
    limit = auto._limit(formats[best_c][0][0])   # of the input auto ran on
    dense = limit <= 0.0 or (auto._density is not None and auto._density > limit)
    case["auto"] = {"gpu_ms": t.gpu_ms, "wall_ms": t.wall_ms, "rel_err": rel_err(y, ref),
                    "path": "dense" if dense else "sparse"}
    cudnn_ms = cudnn[best_c]["gpu_ms"]
    x_bytes = 2 * nchw[0].numel()
    case.update({
        "cudnn": cudnn, "cudnn_best": best_c, "cudnn_ms": cudnn_ms,
        "pitgen": pit, "pitgen_best": best_p, "pitgen_ms": pit[best_p]["gpu_ms"],
        "index_ms": index, "compute_ms": pit[best_p]["gpu_ms"] - index[best_p],
        "ratio": pit[best_p]["gpu_ms"] / cudnn_ms,
        "auto_ratio": case["auto"]["gpu_ms"] / cudnn_ms,
        "wall_ratio": pit[best_p]["wall_ms"] / cudnn[best_c]["wall_ms"],
        "floor_flops_ms": case["density"] * cudnn_ms,
        "floor_bytes_ms": x_bytes / r.ceilings.copy_bytes_per_ms,
    })
    case["floor_ms"] = max(case["floor_flops_ms"], case["floor_bytes_ms"])
    case["ok"] = all(v["rel_err"] <= TOL for v in (*pit.values(), case["auto"]))
    print(f"conv {name} {sparsity:.0%}: pitgen {case['pitgen_ms']:.4f} ms ({best_p}), cuDNN "
          f"{cudnn_ms:.4f} ms ({best_c}), ratio {case['ratio']:.2f}, auto "
          f"{case['auto_ratio']:.2f} ({case['auto']['path']})", file=sys.stderr, flush=True)
    return case


def summary(rows: list[dict]) -> dict:
    """Geometric means of pitgen / cuDNN at 90% and auto / cuDNN at 0%, against the targets."""
    at90 = geomean([x["ratio"] for x in rows if x["sparsity"] == 0.9])
    auto0 = geomean([x["auto_ratio"] for x in rows if x["sparsity"] == 0.0])
    head = next((x["ratio"] for x in rows if x["shape"] == SHAPES[0][0] and x["sparsity"] == 0.9),
                None)
    return {"ratio_90_geomean": at90, "ratio_90_headline": head, "target_90": TARGET_90,
            "met_90": None if head is None else head <= TARGET_90,
            "auto_0_geomean": auto0, "target_auto_0": TARGET_AUTO_0,
            "met_auto_0": None if auto0 is None else auto0 <= TARGET_AUTO_0,
            "all_correct": all(x["ok"] for x in rows)}


def write(out: Path, rows: list[dict], meta: dict) -> None:
    s = summary(rows)
    write_json(out / "conv.json", {"meta": meta, "summary": s, "rows": rows})

    def met(v: Any) -> str:
        return "-" if v is None else "**met**" if v else "**missed**"

    lines = ["# Sparse-channel convolution: pitgen vs cuDNN", "",
             f"Device: **{meta['device']}** (torch {meta['torch']}, CUDA {meta['cuda']}); "
             f"{meta['date']}. fp16, batch 32, ResNet-50 stage shapes; X = ReLU(N(0, 1)) with "
             "the given share of channels zero in every sample, three inputs with other zero "
             "channels rotating. GPU ms: median of "
             f"{meta['repeats']} runs (CUDA events, L2 flushed); wall ms: eager, per call. "
             "pitgen = index + gather + GEMM, cuDNN = `torch.nn.functional.conv2d`, each the "
             "faster of NCHW and channels_last; ratio = pitgen / cuDNN (lower is better).", "",
             "## Targets", ""]
    lines += md_table(["what", "value", "target", ""], [
        ["pitgen / cuDNN, 56x56 3x3 at 90%", fmt_x(s["ratio_90_headline"]),
         f"<= {TARGET_90}x", met(s["met_90"])],
        ["pitgen / cuDNN at 90%, geomean of shapes", fmt_x(s["ratio_90_geomean"]), "", ""],
        ["auto / cuDNN at 0%, geomean of shapes", fmt_x(s["auto_0_geomean"]),
         f"<= {TARGET_AUTO_0}x", met(s["met_auto_0"])],
        ["every result correct", "yes" if s["all_correct"] else "NO", "", ""]])
    lines += ["", "## Cases", ""] + md_table(
        ["shape", "sparsity", "active", "pitgen ms (wall)", "index ms", "gather+GEMM ms",
         "cuDNN ms (wall)", "ratio", "floor ms (FLOPs / bytes)", "auto ms", "auto ratio",
         "rel err"],
        [[x["shape"], f"{x['sparsity']:.0%}", f"{x['density']:.0%}",
          f"{fmt(x['pitgen_ms'], 4)} ({fmt(x['pitgen'][x['pitgen_best']]['wall_ms'], 3)}) "
          f"{x['pitgen_best']}", fmt(x["index_ms"][x["pitgen_best"]], 4),
          fmt(x["compute_ms"], 4),
          f"{fmt(x['cudnn_ms'], 4)} ({fmt(x['cudnn'][x['cudnn_best']]['wall_ms'], 3)}) "
          f"{x['cudnn_best']}", fmt_x(x["ratio"]),
          f"{fmt(x['floor_ms'], 4)} ({fmt(x['floor_flops_ms'], 4)} / "
          f"{fmt(x['floor_bytes_ms'], 4)})",
          f"{fmt(x['auto']['gpu_ms'], 4)} {x['auto']['path']}", fmt_x(x["auto_ratio"]),
          f"{max(v['rel_err'] for v in (*x['pitgen'].values(), x['auto'])):.1e}"
          + ("" if x["ok"] else " **WRONG**")]
         for x in rows])
    (out / "conv.md").write_text("\n".join(lines) + "\n")


def run(r: Run) -> int:
    """Every shape at every sparsity (quick: two shapes); files rewritten after each shape."""
    import torch
    t0 = time.monotonic()
    rows: list[dict] = []
    meta = {**r.meta, "quick": r.args.quick}
    for name, xs, ws, pad in SHAPES:
        if r.args.quick and name not in QUICK:
            continue
        for sp in SPARSITIES:
            rows.append(run_case(r, name, xs, ws, pad, sp))
            torch.cuda.empty_cache()
        meta["elapsed_s"] = time.monotonic() - t0
        write(r.out, rows, meta)
    print((r.out / "conv.md").read_text().split("## Cases")[0])
    return 0 if all(x["ok"] for x in rows) else 1
