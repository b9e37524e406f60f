"""The ``pitgen`` command line: thin wrappers over the library, one subcommand per stage."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import numpy as np

from .errors import PitgenError


def _rules(args: argparse.Namespace) -> None:
    from .expr import parse
    from .rules import analyse

    rules = analyse(parse(args.expr))
    print(json.dumps(rules.to_json(), indent=2) if args.json else rules.explain())


def _plan(args: argparse.Namespace) -> None:
    from .expr import parse
    from .plan import make_plan

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
