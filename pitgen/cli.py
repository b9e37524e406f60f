"""The ``pitgen`` command line: thin wrappers over the library, one subcommand per stage."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

import numpy as np

from .errors import PitgenError


def _rules(args: argparse.Namespace) -> None:
    from .expr import parse
    from .rules import analyse

    rules = analyse(parse(args.expr))
    print(json.dumps(rules.to_json(), indent=2) if args.json else rules.explain())


def _plan(args: argparse.Namespace) -> None:
    from .expr import parse
    from .planner import make_plan

    try:
        mask = np.load(args.mask)
    except (OSError, ValueError, EOFError) as e:
        raise PitgenError(f"cannot read mask {args.mask!r}: {e}") from None
    plan = make_plan(parse(args.expr), args.sparse, mask=mask, tile=args.tile)
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.table())


def _emit(args: argparse.Namespace) -> None:
    """Every kernel is planned and rendered (or refused) before the first file is written."""
    import tempfile
    from pathlib import Path

    from .emit import (CATALOGUE, DEFAULT_ARCH, DEFAULT_DTYPE, Progress, Request, compile_objects,
                       emit_all, jobs, listing, write)

    kernel_opts = any(getattr(args, o) is not None
                      for o in ("sparse", "dtype", "micro_tile", "tile", "arch", "out"))
    if args.list or args.catalogue:
        if args.expr or kernel_opts or (args.list and args.catalogue):
            raise PitgenError("--list and --catalogue take no expression or kernel options")
        requests = list(CATALOGUE)
    else:
        missing = [o for o, v in (("EXPR", args.expr), ("--sparse", args.sparse),
                                  ("--micro-tile", args.micro_tile), ("--out", args.out)) if not v]
        if missing:
            raise PitgenError(f"emit needs {', '.join(missing)} (or --catalogue DIR, or --list)")
        requests = [Request(args.expr, args.sparse, args.micro_tile, args.dtype or DEFAULT_DTYPE,
                            args.tile, args.arch or DEFAULT_ARCH)]
    items = emit_all(requests, Progress("emit", len(requests)))
    if args.list:
        print(listing(items))
        return
    paths = write(items, Path(args.catalogue or args.out))
    print("\n".join(map(str, paths)))
    if args.compile:
        sources = [p for p in paths if p.suffix == ".cu"]
        archs = sorted({r.arch for r in requests})
        with tempfile.TemporaryDirectory(prefix="pitgen-emit-") as tmp:
            compile_objects(sources, archs, Path(tmp), jobs(), Progress("nvcc", len(sources)))
        print(f"compiled {len(sources)} source(s) with nvcc for {', '.join(archs)}", file=sys.stderr)


def load_graph_arg(spec: str, scale: float = 1.0, seed: int = 0) -> Any:
    """GRAPH of ``pitgen tune``: a .npz sparse matrix (scipy's save_npz or make_graphs' plain
    arrays) or ``synthetic:NAME``, a graph of :mod:`pitgen.graph.synthetic`."""
    from pathlib import Path

    from .graph.formats import load_graph

    if spec.startswith("synthetic:"):
        from .graph import synthetic

        name = spec.split(":", 1)[1]
        if name not in synthetic.GRAPHS:
            raise PitgenError(f"unknown synthetic graph {name!r}; known: {', '.join(synthetic.GRAPHS)}")
        if not 0 < scale <= 1:
            raise PitgenError(f"--scale must be in (0, 1], got {scale}")
        return synthetic.make_graph(name, seed=seed, scale=scale)
    if scale != 1.0:
        raise PitgenError("--scale applies to synthetic:NAME graphs only")
    try:
        return load_graph(spec)
    except (OSError, ValueError, EOFError, KeyError) as e:
        if isinstance(e, PitgenError):
            raise
        raise PitgenError(f"cannot read graph {spec!r}: {e}") from None


def tune_options(args: argparse.Namespace) -> tuple[str, int, str, float, list[str]]:
    """Validated (op, feat, dtype, budget, formats) of ``pitgen tune``: no GPU needed."""
    from .graph.jit import GRAPH_DTYPES
    from .graph.tune import FORMATS, OPS

    if args.op not in OPS:
        raise PitgenError(f"--op must be one of {', '.join(OPS)}, got {args.op!r}")
    if args.feat < 1:
        raise PitgenError(f"--feat must be >= 1, got {args.feat}")
    if args.dtype not in GRAPH_DTYPES:
        raise PitgenError(f"--dtype must be one of {', '.join(GRAPH_DTYPES)}, got {args.dtype!r}")
    if not args.budget > 0:
        raise PitgenError(f"--budget must be > 0 seconds, got {args.budget}")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise PitgenError(f"--formats: unknown format(s) {bad or args.formats!r}; choose from "
                          f"{','.join(FORMATS)}")
    return args.op, args.feat, args.dtype, args.budget, formats


def _tune(args: argparse.Namespace) -> None:
    """Options and graph are checked before the GPU is touched."""
    from .errors import DeviceError
    from .graph.tune import tune

    op, feat, dtype, budget, formats = tune_options(args)
    csr = load_graph_arg(args.graph, args.scale, args.seed)
    try:
        import torch  # noqa: F401

        from .graph.device import DeviceCSR
    except ImportError as e:
        raise DeviceError(f"pitgen tune runs on the GPU and needs torch: {e}") from None
    a = DeviceCSR.from_host(csr, dtype)
    result = tune(a, op, feat, dtype, budget_s=budget, formats=formats, cache=not args.no_cache)
    if args.json:
        doc = result.to_json()
        doc["graph"] = {"spec": args.graph, "rows": csr.shape[0], "cols": csr.shape[1],
                        "nnz": csr.nnz}
        print(json.dumps(doc, indent=2))
        return
    print(f"graph {args.graph}: {csr.shape[0]} x {csr.shape[1]}, {csr.nnz} non-zeros")
    print(result.summary())
    failed = [t for t in result.log if t.status != "ok"]
    for t in failed:
        print(f"  {t.status}: {t.fmt} {t.params} {t.schedule}: {t.reason}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pitgen", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("rules", help="derive the PIT rules (invariant axes) of an expression")
    r.add_argument("expr", help="e.g. 'C[m,n] += A[m,k] * B[k,n]'")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.set_defaults(func=_rules)

    pl = sub.add_parser("plan", help="choose a micro-tile for a sparse operand from its mask")
    pl.add_argument("--expr", required=True)
    pl.add_argument("--sparse", required=True, help="name of the sparse operand, e.g. A")
    pl.add_argument("--mask", required=True, help=".npy file: boolean mask of the operand's shape")
    pl.add_argument("--tile", default=None, help="dense compute tile, e.g. 64x64x32 (axis order)")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=_plan)

    e = sub.add_parser("emit", help="write standalone kernels (.cu + .h with a C API) for other projects")
    e.add_argument("expr", nargs="?", help="e.g. 'C[m,n] += A[m,k] * B[k,n]'")
    e.add_argument("--sparse", help="name of the sparse operand, e.g. A")
    e.add_argument("--dtype", help="float16 (default), bfloat16 or float32")
    e.add_argument("--micro-tile", help="micro-tile or block of the sparse operand, e.g. 32x1 (dim order)")
    e.add_argument("--tile", help="compute tile, e.g. 64x128x32 (axis order)")
    e.add_argument("--arch", help="architecture the tile must fit, sm_80 (default) or newer")
    e.add_argument("--out", help="directory for <name>.cu and <name>.h")
    e.add_argument("--catalogue", metavar="DIR", help="write pitgen's catalogue of kernels into DIR")
    e.add_argument("--list", action="store_true", help="list the catalogue's kernels")
    e.add_argument("--compile", action="store_true", help="check that the files build with nvcc")
    e.set_defaults(func=_emit)

    t = sub.add_parser("tune", help="search formats x schedules for a graph operator (GPU)")
    t.add_argument("graph", help="a .npz sparse matrix, or synthetic:NAME (cora, pubmed, reddit, ...)")
    t.add_argument("--op", default="spmm", help="spmm (default) or sddmm")
    t.add_argument("--feat", type=int, default=128, help="feature width (default 128)")
    t.add_argument("--dtype", default="float16", help="float16 (default) or float32")
    t.add_argument("--budget", type=float, default=60.0, help="search seconds (default 60)")
    t.add_argument("--formats", default="csr,ell,bsr,hyb", help="comma-separated formats to search")
    t.add_argument("--scale", type=float, default=1.0, help="shrink a synthetic graph by this")
    t.add_argument("--seed", type=int, default=0, help="seed of a synthetic graph")
    t.add_argument("--no-cache", action="store_true", help="do not store the result in the tune cache")
    t.add_argument("--json", action="store_true", help="the whole result, every trial included")
    t.set_defaults(func=_tune)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except PitgenError as e:
        print(f"pitgen: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
