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
