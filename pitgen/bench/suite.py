"""``pitgen bench``: pitgen's benchmark suite from an install, on one GPU.

    pitgen bench [PART ...] [--quick] [--out DIR] [--repeats N] [--budget S] [part options]
    python -m pitgen.bench ...                 # the same without the pitgen command
    pitgen bench peers --replot DIR            # peers' tables and plots again, no GPU needed

Every part times with one :class:`~pitgen.bench.timing.Timer` and is judged against the
device's ceilings (copy rate, dense matmul rate) measured at the start of the same run. Results
go to --out, a Markdown table and JSON per part; progress goes to stderr, tables to stdout.
The exit status is 1 when a part failed or a pitgen result was wrong.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .report import describe
from .timing import Ceilings, Timer

#: Part -> what it measures (and the file it writes), in run order: quick parts first.
PARTS = {
    "matmul": "pitgen's sparse matmul vs dense cuBLAS: index build and kernel apart, compile "
              "and cached-load times (matmul.md)",
    "attention": "dynamic sparse attention vs dense SDPA, SDPA with the mask and FlexAttention "
                 "(attention.md)",
    "moe": "the fused MoE layer vs a loop over experts, torch._grouped_mm and stk "
           "(moe_layer.md)",
    "training": "one sparse-training step of a linear layer vs the dense and masked dense "
                "steps (training.md)",
    "compiled": "a training step of a block of pitgen modules (SparseAttention, SparseLinear, "
                "MoE) under torch.compile(fullgraph=True) vs eager (compiled.md)",
    "graphs": "GNN SpMM / SDDMM on seven synthetic graphs, tuned formats vs cuSPARSE "
              "(graphs.md)",
    "dynamic": "graphs that change every call: GPU conversions to hyb / ELL / BSR vs the SpMM "
               "they feed, and a new edge list per call (CSR build, format, SpMM) vs torch's "
               "CSR build and torch.sparse.mm (dynamic.md)",
    "rgcn": "the RGCN inference layer on four relational graphs vs a torch loop over relations "
            "and torch._grouped_mm (rgcn.md)",
    "sage": "a GraphSAGE training step on the seven GNN graphs vs the same model on "
            "torch.sparse.mm (sage.md)",
    "conv": "convolution over sparse input channels (ResNet-50 stage shapes at 0/50/90% zero "
            "channels) vs cuDNN in both memory formats, and SparseConv2d's auto (conv.md)",
    "peers": "PIT's workloads (micro, seqlen, ffn, moe) vs cuBLAS, cuSPARSE, Triton BSR and stk "
             "(summary.md)",
}


@dataclass
class Run:
    """What every part gets: the options, one timer, the ceilings and the run's metadata."""

    args: argparse.Namespace
    out: Path
    timer: Timer
    ceilings: Ceilings
    meta: dict  #: device_meta(), the mode and the ceilings, written beside every result

    def budget(self, default: float) -> float:
        """Seconds after which the part skips what is left (--budget, else the part's own)."""
        return self.args.budget if self.args.budget is not None else default


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parser() -> argparse.ArgumentParser:
    from .peers import parse_workloads

    ap = argparse.ArgumentParser(
        prog="pitgen bench", description="pitgen's benchmark suite on one GPU: the parts "
        "named (all when none is), each judged against the device's ceilings measured in the "
        "same run.",
        epilog="parts: " + "; ".join(f"{k}: {v}" for k, v in PARTS.items()))
    ap.add_argument("parts", nargs="*", metavar="PART",
                    help=f"what to run: {', '.join(PARTS)} (default: all, in that order)")
    ap.add_argument("--quick", action="store_true",
                    help="every kind of configuration, fewer of them (minutes, not tens)")
    ap.add_argument("--out", default="pitgen-bench", help="output folder (default ./pitgen-bench)")
    ap.add_argument("--repeats", type=int, help="timed runs per median (default 20, quick 10)")
    ap.add_argument("--budget", type=float,
                    help="seconds per part after which its remaining configurations are "
                         "skipped and listed (default: peers 500, graphs 220)")
    g = ap.add_argument_group("matmul")
    g.add_argument("--size", type=int, default=4096, help="M = N = K (default 4096)")
    g.add_argument("--sparsity", type=_csv,
                   help="sparsities in %% (default 0,50,90,95,99; quick 0,90,99)")
    g.add_argument("--granularity", type=_csv,
                   help="mask units (default 32x1,1x64,32x64,128x128; quick 32x1,32x64,128x128)")
    g = ap.add_argument_group("moe")
    g.add_argument("--experts", type=_csv, help="expert counts (default 8,64,128, top-1 and top-2; quick 64, top-1)")
    g.add_argument("--stk-only", action="store_true", help=argparse.SUPPRESS)
    g = ap.add_argument_group("graphs")
    g.add_argument("--graphs", help="folder caching the generated graphs "
                                    "(default <pitgen cache>/graphs)")
    g.add_argument("--tune-budget", type=float,
                   help="tuning seconds per case (default 0.25 below 1M edges, 0.75 above)")
    g = ap.add_argument_group("peers")
    g.add_argument("--workloads", type=parse_workloads,
                   help="comma-separated subset of micro,seqlen,ffn,moe (default all)")
    g.add_argument("--replot", metavar="DIR", help="rewrite tables, plots and summary from "
                                                   "DIR/bench.json (no GPU needed)")
    g.add_argument("--tar", help="bundle path when there are more than 8 files "
                                 "(default OUT/bench_results.tar)")
    return ap


def _check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if args.repeats is not None and args.repeats < 1:
        ap.error("--repeats must be at least 1")
    for name in ("budget", "tune_budget"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    for g in args.granularity or []:
        if len(g.split("x")) != 2 or not all(v.isdigit() and int(v) > 0 for v in g.split("x")):
            ap.error(f"--granularity {g!r}: expected ROWSxCOLS, e.g. 32x1")
    for name in ("sparsity", "experts"):
        try:
            [float(v) for v in getattr(args, name) or []]
        except ValueError:
            ap.error(f"--{name}: numbers separated by commas")


def gpu_missing() -> str | None:
    """Why the GPU parts cannot run here, or None when they can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install torch)"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("pycuda") is None:  # pitgen's runtime
        return "pycuda is not installed (pip install 'pitgen[cuda]')"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected parts; 0 when all ran and every pitgen result was right, 1 otherwise
    (2 for a bad command line)."""
    ap = parser()
    try:
        args = ap.parse_args(argv)
        _check(ap, args)
    except SystemExit as e:  # --help, or a usage error argparse has printed
        return e.code if isinstance(e.code, int) else 2
    if args.replot:
        from .peers import replot

        return replot(Path(args.replot), args.tar)
    why = gpu_missing()
    if why:
        print(f"pitgen: error: pitgen bench needs a CUDA GPU: {why}", file=sys.stderr)
        return 1
    import torch

    from .timing import device_meta, measure_ceilings

    timer = Timer(args.repeats or (10 if args.quick else 20))
    if args.stk_only:
        from .moe import stk_only

        return stk_only(timer, args)
    print("measuring the device's ceilings (copy rate, dense matmul)", file=sys.stderr, flush=True)
    ceilings = measure_ceilings(timer)
    meta = {**device_meta(), "mode": "quick" if args.quick else "full",
            "repeats": timer.repeats, **ceilings.to_json()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rc = 0
    for name in [p for p in PARTS if p in (args.parts or PARTS)]:
        t = time.monotonic()
        print(f"pitgen bench: {name}", file=sys.stderr, flush=True)
        try:
            part = importlib.import_module(f"{__package__}.{name}")
            rc |= part.run(Run(args, out, timer, ceilings, meta))
        except Exception as e:  # one broken part must not take the others' results with it
            traceback.print_exc()
            print(f"pitgen bench: {name} failed: {describe(e)}", file=sys.stderr, flush=True)
            rc = 1
        torch.cuda.empty_cache()
        print(f"pitgen bench: {name} done in {time.monotonic() - t:.0f} s", file=sys.stderr,
              flush=True)
    return rc
