"""The ``pitgen`` command line: thin wrappers over the library, one subcommand per stage.

Exit status: 0 done; 1 a :class:`PitgenError` while running (``pitgen: error: ...``), or what
the machine refused (memory, a file, a missing package: one line too); 2 a usage error
(argparse's, or an option value or combination checked before anything runs: usage and message
as argparse prints them); 3 an internal error (a bug in pitgen: one line, please report it);
141 when stdout is closed early (``pitgen rules EXPR | head``: the status a shell reports for a
tool that SIGPIPE ends); 130 on Ctrl-C. No status comes with a traceback."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .emit import ARCH_SMEM, CATALOGUE, DEFAULT_ARCH, DEFAULT_DTYPE, Progress, Request, compile_objects, emit_all, jobs, listing, write
from .errors import DeviceError, FileError, PitgenError
from .expr import parse
from . import cache, graphs
from .graph.device import VALUE_DTYPES, DeviceCSR
from .graph.formats import FORMATS, load_graph
from .graph.kernels import OPS
from .graph.model import decide
from .graph.tune import GraphStats, tune
from .lower import DTYPES
from .planner import make_plan
from .rules import analyse
from .version import __version__

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
#: 128 + SIGPIPE: ``set -o pipefail`` scripts see for pitgen what they see for cat or seq.
EXIT_PIPE = 141
EXIT_INTERRUPTED = 130
MATMUL = "C[m,n] += A[m,k] * B[k,n]"


class UsageError(PitgenError):
    """A bad option value or combination, found before anything runs: exit status 2."""


def _say(msg: str) -> None:
    """Progress for steps that take seconds: stderr, so stdout stays the result."""
    print(f"pitgen: {msg}", file=sys.stderr, flush=True)


def _rules(args: argparse.Namespace) -> None:

    rules = analyse(parse(args.expr))
    print(json.dumps(rules.to_json(), indent=2) if args.json else rules.explain())


def _plan(args: argparse.Namespace) -> None:

    try:
        mask = np.load(args.mask)
    except (OSError, ValueError, EOFError) as e:
        raise FileError(f"cannot read mask {args.mask!r}: {e}") from None
    plan = make_plan(parse(args.expr), args.sparse, mask=mask, tile=args.tile, width=args.width)
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.table())


def _emit(args: argparse.Namespace) -> None:
    """Every kernel is planned and rendered (or refused) before the first file is written."""

    kernel_opts = any(getattr(args, o) is not None
                      for o in ("sparse", "dtype", "micro_tile", "tile", "arch", "out"))
    if args.list or args.catalogue:
        if args.expr or kernel_opts or (args.list and args.catalogue):
            raise UsageError("--list and --catalogue take no expression or kernel options")
        requests = list(CATALOGUE)
    else:
        missing = [o for o, v in (("EXPR", args.expr), ("--sparse", args.sparse),
                                  ("--micro-tile", args.micro_tile), ("--out", args.out)) if not v]
        if missing:
            raise UsageError(f"emit needs {', '.join(missing)} (or --catalogue DIR, or --list)")
        requests = [Request(args.expr, args.sparse, args.micro_tile, args.dtype or DEFAULT_DTYPE,
                            args.tile, args.arch or DEFAULT_ARCH)]
    if args.compile and args.list:
        raise UsageError("--compile needs files: use it with --out or --catalogue, not --list")
    items = emit_all(requests, Progress("emit", len(requests)))
    if args.list:
        print(listing(items))
        return
    paths = write(items, Path(args.catalogue or args.out))
    print("\n".join(map(str, paths)), flush=True)
    if args.compile:
        sources = [p for p in paths if p.suffix == ".cu"]
        archs = sorted({r.arch for r in requests})
        _say(f"compiling {len(sources)} source(s) with nvcc for {', '.join(archs)} ...")
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="pitgen-emit-") as tmp:
            compile_objects(sources, archs, Path(tmp), jobs(), Progress("nvcc", len(sources)))
        _say(f"compiled {len(sources)} source(s) with nvcc for {', '.join(archs)} "
             f"in {time.perf_counter() - t0:.1f} s")


def load_graph_arg(spec: str, scale: float = 1.0, seed: int = 0) -> Any:
    """GRAPH of ``pitgen tune``: a .npz sparse matrix (scipy's save_npz or make_graphs' plain
    arrays) or ``synthetic:NAME``, a graph of :mod:`pitgen.graphs`. A bad name or
    ``scale`` is a :class:`UsageError`; an unreadable file a :class:`FileError`."""

    if spec.startswith("synthetic:"):

        name = spec.split(":", 1)[1]
        if name not in graphs.GRAPHS:
            raise UsageError(f"unknown synthetic graph {name!r}; known: {', '.join(graphs.GRAPHS)}")
        if not 0 < scale <= 1:
            raise UsageError(f"--scale must be in (0, 1], got {scale}")
        return graphs.make_graph(name, seed=seed, scale=scale)
    if scale != 1.0:
        raise UsageError("--scale applies to synthetic:NAME graphs only")
    return load_graph(spec)


def _tune(args: argparse.Namespace) -> None:
    """The graph is loaded (and the options checked) before the GPU is touched; each measured
    trial is a progress line on stderr."""

    t0 = time.perf_counter()
    csr = load_graph_arg(args.graph, args.scale, args.seed)
    _say(f"tune: graph {args.graph}: {csr.shape[0]} x {csr.shape[1]}, {csr.nnz} non-zeros "
         f"(loaded in {time.perf_counter() - t0:.1f} s)")
    try:
        import torch  # noqa: F401

    except ImportError as e:
        raise DeviceError(f"pitgen tune runs on the GPU and needs torch: {e}") from None
    stats = GraphStats.from_lengths(np.diff(np.asarray(csr.indptr, np.int64)), csr.shape[1])
    _say(f"tune: the cost model (format='auto' without a search) picks "
         f"{decide(stats, args.op, args.feat, args.dtype, args.formats).summary()}")
    a = DeviceCSR.from_host(csr, args.dtype)
    _say(f"tune: searching {args.op} (feat {args.feat}, {args.dtype}) over "
         f"{','.join(args.formats)} for up to {args.budget:g} s ...")
    def trial(t: Any, elapsed: float) -> None:
        took = f"{t.ms:.3f} ms" if t.ms is not None else t.status
        _say(f"tune: {elapsed:5.1f}/{args.budget:g} s  {t.fmt} {t.params or ''} {t.schedule} "
             f"-> {took}")

    result = tune(a, args.op, args.feat, args.dtype, budget_s=args.budget, formats=args.formats,
                  cache=not args.no_cache, progress=trial)
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


def _bench(argv: list[str]) -> int:
    """``pitgen bench ARGS``: ARGS go unchanged to :func:`pitgen.bench.main` (its options, its
    --help, its progress); imported only here, since it is optional and pulls in plotting."""
    import importlib

    try:
        bench = importlib.import_module(f"{__package__}.bench")
    except ImportError as e:
        if e.name == f"{__package__}.bench":
            raise PitgenError("this pitgen has no benchmark suite (the pitgen.bench package is "
                              "missing)") from None
        raise PitgenError(f"pitgen bench needs {e.name or e}: pip install 'pitgen[bench]'") from None
    t0 = time.perf_counter()
    status = bench.main(argv)
    if time.perf_counter() - t0 >= 1:
        _say(f"bench: finished in {time.perf_counter() - t0:.1f} s (exit status {status})")
    return status


def _at_least(minimum: float, kind: Callable[[str], Any], strict: bool = False
              ) -> Callable[[str], Any]:
    """An argparse type: ``kind`` (int or float) at least (or, ``strict``, above) ``minimum``."""
    def check(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum:g}, "
                                             f"got {text}")
        return value
    return check


def _formats(text: str) -> list[str]:
    """An argparse type: comma-separated formats of ``pitgen tune``, each one checked."""

    items = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in items if f not in FORMATS]
    if bad or not items:
        what = f"unknown format(s) {', '.join(map(repr, bad))}" if bad else "no format given"
        raise argparse.ArgumentTypeError(f"{what}; choose from {','.join(FORMATS)}")
    return items


def _areas(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated cache areas of ``pitgen cache``, each one checked."""
    items = tuple(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    bad = [a for a in items if a not in cache.AREAS]
    if bad or not items:
        what = f"unknown area(s) {', '.join(map(repr, bad))}" if bad else "no area given"
        raise argparse.ArgumentTypeError(f"{what}; choose from {','.join(cache.AREAS)}")
    return items


def _cache(args: argparse.Namespace) -> None:
    """``info``: each area's folder, files and size; ``clear``: remove them (folders stay)."""
    if args.action == "clear":
        removed = cache.disk_clear(args.only)
        if args.json:
            print(json.dumps({"removed": removed}, indent=2))
            return
        for area, n in removed.items():
            print(f"{area}: removed {n} file(s) from {cache.area_path(area)}")
        return
    usage = {a: u for a, u in cache.disk_usage().items() if a in args.only}
    if args.json:
        print(json.dumps(usage, indent=2))
        return
    for area, u in usage.items():
        print(f"{area:8s} {u['files']:6d} file(s) {u['bytes'] / 2**20:10.1f} MiB  {u['path']}")


def _subcommand(sub: Any, name: str, summary: str, example: str,
                func: Callable[[argparse.Namespace], None]) -> argparse.ArgumentParser:
    """A subcommand whose --help ends with an example; it reports its own usage errors."""
    sp = sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".",
                        epilog=example, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.set_defaults(func=func, parser=sp)
    return sp


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand but ``bench``'s arguments, which go to pitgen.bench."""

    p = argparse.ArgumentParser(
        prog="pitgen", description="CUDA kernels for dynamically sparse operators (PIT): one "
        "subcommand per stage, from an expression's rules to standalone kernels.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"examples:\n  pitgen rules '{MATMUL}'\n  pitgen emit --list\n"
               "  pitgen bench --help       # the benchmark suite's own options\n\n"
               f"exit status: {EXIT_OK} done, {EXIT_ERROR} error while running, {EXIT_USAGE} usage "
               f"error, {EXIT_INTERNAL} internal error (a bug), {EXIT_PIPE} output closed early "
               f"(| head), {EXIT_INTERRUPTED} interrupted")
    p.add_argument("--version", action="version", version=f"pitgen {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = _subcommand(sub, "rules", "derive the PIT rules (invariant axes) of an expression",
                    f"example:\n  pitgen rules '{MATMUL}' --json", _rules)
    r.add_argument("expr", metavar="EXPR", help=f"e.g. '{MATMUL}'")
    r.add_argument("--json", action="store_true", help="machine-readable output")

    pl = _subcommand(sub, "plan", "choose a micro-tile for a sparse operand from its mask",
                     f"example:\n  pitgen plan '{MATMUL}' --sparse A --mask mask.npy --json",
                     _plan)
    pl.add_argument("expr", metavar="EXPR", help=f"e.g. '{MATMUL}'")
    pl.add_argument("--sparse", required=True, help="name of the sparse operand, e.g. A")
    pl.add_argument("--mask", required=True, help=".npy file: boolean mask of the operand's shape")
    pl.add_argument("--tile", default=None, help="dense compute tile, e.g. 64x64x32 (axis order)")
    pl.add_argument("--width", type=_at_least(1, int), default=None,
                    help="the product's other extent (N of a matmul), which the kernels' costs "
                         "scale with (default: the profile's own, 4096)")
    pl.add_argument("--json", action="store_true", help="machine-readable output")

    e = _subcommand(sub, "emit", "write standalone kernels (.cu + .h with a C API) for other projects",
                    f"examples:\n  pitgen emit '{MATMUL}' --sparse A --micro-tile 32x1 --out kernels/ "
                    "--compile\n  pitgen emit --catalogue generated/\n  pitgen emit --list", _emit)
    e.add_argument("expr", metavar="EXPR", nargs="?", help=f"e.g. '{MATMUL}'")
    e.add_argument("--sparse", help="name of the sparse operand, e.g. A")
    e.add_argument("--dtype", choices=list(DTYPES), help=f"element type (default {DEFAULT_DTYPE})")
    e.add_argument("--micro-tile", help="micro-tile or block of the sparse operand, e.g. 32x1 (dim order)")
    e.add_argument("--tile", help="compute tile, e.g. 64x128x32 (axis order)")
    e.add_argument("--arch", choices=list(ARCH_SMEM),
                   help=f"architecture the tile must fit (default {DEFAULT_ARCH})")
    e.add_argument("--out", help="directory for <name>.cu and <name>.h")
    e.add_argument("--catalogue", metavar="DIR", help="write pitgen's catalogue of kernels into DIR")
    e.add_argument("--list", action="store_true", help="list the catalogue's kernels")
    e.add_argument("--compile", action="store_true", help="check that the files build with nvcc")

    t = _subcommand(sub, "tune", "search formats x schedules for a graph operator (GPU)",
                    "example:\n  pitgen tune synthetic:cora --op spmm --feat 128 --budget 30", _tune)
    t.add_argument("graph", metavar="GRAPH",
                   help="a .npz sparse matrix, or synthetic:NAME (cora, pubmed, reddit, ...)")
    t.add_argument("--op", default="spmm", choices=OPS, help="operator (default spmm)")
    t.add_argument("--feat", type=_at_least(1, int), default=128, help="feature width (default 128)")
    t.add_argument("--dtype", default="float16", choices=VALUE_DTYPES,
                   help="element type (default float16)")
    t.add_argument("--budget", type=_at_least(0, float, strict=True), default=60.0,
                   help="search seconds (default 60)")
    t.add_argument("--formats", type=_formats, default=",".join(FORMATS),
                   help=f"comma-separated formats to search (default {','.join(FORMATS)})")
    t.add_argument("--scale", type=float, default=1.0, help="shrink a synthetic graph by this")
    t.add_argument("--seed", type=int, default=0, help="seed of a synthetic graph")
    t.add_argument("--no-cache", action="store_true", help="do not store the result in the tune cache")
    t.add_argument("--json", action="store_true", help="the whole result, every trial included")

    c = _subcommand(sub, "cache", "show or empty pitgen's on-disk cache (kernels, tune results, "
                    "graphs)", "examples:\n  pitgen cache info\n  pitgen cache clear --only tune",
                    _cache)
    c.add_argument("action", choices=("info", "clear"), help="info: folders, files and bytes; "
                   "clear: remove the files")
    c.add_argument("--only", type=_areas, default=",".join(cache.AREAS),
                   help=f"comma-separated areas (default {','.join(cache.AREAS)})")
    c.add_argument("--json", action="store_true", help="machine-readable output")

    sub.add_parser("bench", add_help=False, help="run the benchmark suite (pitgen.bench; "
                   "every argument goes to it: pitgen bench --help)")
    return p


def _run(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:  # verbatim: argparse would reorder or claim its options
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except UsageError as e:
        args.parser.error(str(e))  # usage and message as argparse's own, then SystemExit(2)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (see ``pitgen --help``) instead of exiting."""
    try:
        status = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return status
    except SystemExit as e:  # argparse (--help, --version, usage errors) or pitgen.bench
        if e.code is None or isinstance(e.code, int):
            return e.code or EXIT_OK
        print(e.code, file=sys.stderr)
        return EXIT_ERROR
    except PitgenError as e:
        return _fail(str(e))
    except BrokenPipeError:
        # Python's advice: the rest of the output goes nowhere, so the exit flush cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except MemoryError:
        return _fail("out of memory (the input asks for more than this machine has)")
    except RecursionError:
        return _fail("input nested too deeply (Python's recursion limit)")
    except OSError as e:
        where = f" {e.filename!r}" if e.filename else ""
        return _fail(f"{e.strerror or e}{where}")
    except ImportError as e:
        return _fail(f"a package pitgen needs here is missing: {e.name or e} ({e})")
    except Exception as e:  # noqa: BLE001 - the contract: one line, never a traceback
        return _fail(f"internal error, a bug in pitgen (please report it with the command): "
                     f"{type(e).__name__}: {e}", EXIT_INTERNAL)


def _fail(message: str, status: int = EXIT_ERROR) -> int:
    """Print ``pitgen: error: message`` on stderr; return ``status``."""
    try:
        print(f"pitgen: error: {message}", file=sys.stderr, flush=True)
    except OSError:  # stderr closed as well: the status alone must say it
        pass
    return status


if __name__ == "__main__":
    sys.exit(main())
