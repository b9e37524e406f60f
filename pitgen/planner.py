"""Choosing how a kernel exploits a sparse operand S: micro-tiles along an invariant axis,
blocks, or dense. The :class:`Plan` is the contract between the rule engine and the CUDA
generator, which reads ``operator``, ``sparse``, ``choice`` (kind, axis, shape) and
``compute_tile``.

Candidates are costed from S's mask with a per-device profile (see ``profiles/``): a dense
tile costs ``fixed_ns + elements * ns_per_element``, every plan pays ``out_ns_per_element`` per
element of the product it writes (S's rows times the product's width, whatever the density),
the dense kernel saves ``zeros_discount`` of its element time in proportion to S's zeros, and
every sparse kind also pays for the online index (one pass over S). A kind's costs are one fit
over its shapes; a shape the profile measured on its own has its own. Micro-tiles along a
spatial axis run on the row-owner kernel, whose time follows its steps (each row block's active
rows of a k-tile, 64 at a time) and the rows it gathers, not a packed element count: their dense
tiles are counted per row block, and their elements are the micro-tiles' own.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import sympy

from . import checks
from .errors import PlanError, RuleError
from .expr import Access, Operator, as_operator
from .limits import INT32_MAX
from .lower import PRODUCTS_EXTENTS, products_fit, rows_block
from .index import as_mask, sparse_access, tile_extents, tile_grid
from .rules import Rules, analyse

#: Extents tried along each non-batch dimension of S for micro-tiles and blocks.
TILE_SIZES = (16, 32, 64, 128)
#: Tie-break on equal cost: the simpler kernel wins.
KIND_RANK = {"dense": 0, "block": 1, "micro": 2}
#: The product width (B's columns) a profile's times were measured at, unless it names one.
PROFILE_WIDTH = 4096
PROFILE_KINDS = ("dense", "block", "micro-reduction", "micro-spatial")
#: ``auto`` takes a sparse plan over dense only when it is priced at least this much cheaper. A
#: sparse plan's price is a linear fit that does not see its waves or its index's shape, and
#: errs by 5-15% where the dense kernel's does not (H200: BERT's 768 -> 768 layer on 16 K
#: tokens, 128 x 128 blocks priced 1.6% under cuBLAS ran 8% over it); a gain smaller than the
#: error is not worth the risk, and passing it up costs at most this fraction.
DENSE_MARGIN = 0.04


@dataclass(frozen=True)
class Candidate:
    """One way to tile S. ``shape`` is in S's dimension order (1 along ``axis`` for a
    micro-tile); ``nonzero`` counts micro-tiles/blocks holding a non-zero (dense: compute tiles
    holding one); ``waste`` is computed-but-zero elements per true non-zero (None: infinite);
    ``dense_tiles`` is the number of dense tiles left after packing (along a spatial axis,
    packed within each row block of the row-owner kernel: its steps)."""

    kind: str  # 'micro' | 'block' | 'dense'
    axis: str | None
    shape: tuple[int, ...]
    nonzero: int
    waste: float | None
    dense_tiles: int
    cost: float

    @property
    def label(self) -> str:
        shape = "x".join(map(str, self.shape))
        if self.kind == "micro":
            return f"micro {shape} along {self.axis}"
        return f"{self.kind} {shape}"

    def to_json(self) -> dict:
        return {"kind": self.kind, "axis": self.axis, "shape": list(self.shape),
                "nonzero": self.nonzero, "waste": self.waste, "dense_tiles": self.dense_tiles,
                "cost": self.cost}


@dataclass(frozen=True, eq=False)
class Plan:
    """The chosen candidate with everything it was chosen from. ``shape`` is S's shape (nominal
    when planned without mask or shape); ``masked``: costed on S's measured sparsity (a mask or
    device counts) rather than at density 1."""

    operator: Operator
    rules: Rules
    sparse: str
    tile: dict[str, int]
    choice: Candidate
    candidates: tuple[Candidate, ...]
    profile: dict
    shape: tuple[int, ...]
    masked: bool

    @property
    def compute_tile(self) -> dict[str, int]:
        """The compute tile with the choice's extents on S's bare dims other than the micro
        axis (the micro axis keeps the tile's extent: that many gathered ids per dense tile).
        Dims of S indexed by an affine expression (conv's ``y+r``) keep the given tile."""
        tile = dict(self.tile)
        if self.choice.kind == "dense":
            return tile
        acc = self.operator.access(self.sparse)
        for e, t in zip(acc.indices, self.choice.shape):
            if isinstance(e, sympy.Symbol) and e.name != self.choice.axis:
                tile[e.name] = t
        return tile

    def to_json(self) -> dict:
        return {"expression": self.operator.text, "sparse": self.sparse,
                "shape": list(self.shape), "masked": self.masked, "tile": dict(self.tile),
                "compute_tile": self.compute_tile, "profile": self.profile["device"],
                "choice": self.choice.to_json(),
                "candidates": [c.to_json() for c in self.candidates]}

    def table(self) -> str:
        """Candidates by cost, the choice marked with '*'."""
        acc = self.operator.access(self.sparse)
        tile = " ".join(f"{a}={t}" for a, t in self.tile.items())
        ct = " ".join(f"{a}={t}" for a, t in self.compute_tile.items())
        src = "measured sparsity" if self.masked else "no mask: density 1"
        lines = [f"plan for {self.operator.text}",
                 f"  sparse {acc} of shape {list(self.shape)} ({src}); tile {tile}",
                 f"  profile: {self.profile['device']}",
                 f"  choice: {self.choice.label}; compute tile {ct}"]
        best = self.candidates[0]
        if best is not self.choice and self.choice.kind == "dense" and best.cost > 0:
            lines.append(f"  (kept over {best.label}, priced {1 - best.cost / self.choice.cost:.1%} "
                         f"cheaper: under the {DENSE_MARGIN:.0%} margin a sparse plan must save)")
        lines.append("")
        head = ("", "kind", "axis", "shape", "nonzero", "waste", "dense tiles", "cost (ns)")
        rows = [head] + [("*" if c is self.choice else "", c.kind, c.axis or "-",
                          "x".join(map(str, c.shape)), str(c.nonzero),
                          "inf" if c.waste is None else f"{c.waste:.3f}", str(c.dense_tiles),
                          f"{c.cost:.1f}") for c in self.candidates]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines += ["  ".join(v.ljust(w) if i < 4 else v.rjust(w)
                            for i, (v, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
        return "\n".join(lines)


# -- profiles ---------------------------------------------------------------------------------

def load_profile(path_or_name: str | os.PathLike | Mapping | None = None) -> dict:
    """A cost profile: a dict, a JSON file path, or the name of one in ``pitgen/profiles``.
    ``None`` prefers ``measured.json`` (written by the GPU calibration script) over
    ``analytic.json`` (a placeholder)."""
    pkg = resources.files("pitgen.profiles")
    if not (path_or_name is None or isinstance(path_or_name, (str, os.PathLike, Mapping))):
        raise PlanError(f"profile must be a name, a JSON file path or a dict, got "
                        f"{path_or_name!r}")
    if isinstance(path_or_name, Mapping):
        try:
            prof, src = json.loads(json.dumps(path_or_name)), "profile dict"
        except (TypeError, ValueError) as e:
            raise PlanError(f"profile dict is not plain JSON data: {e}") from None
    else:
        if path_or_name is None:
            res = pkg / "measured.json"
            src = res if res.is_file() else pkg / "analytic.json"
        elif (isinstance(path_or_name, os.PathLike) or os.sep in path_or_name
              or path_or_name.endswith(".json")):
            src = Path(path_or_name)
        else:
            src = pkg / f"{path_or_name}.json"
        try:
            prof = json.loads(src.read_text())
        except (OSError, ValueError) as e:
            raise PlanError(f"cannot read profile {str(src)!r}: {e}") from None
    _check_profile(prof, str(src))
    return prof


def _check_profile(prof: Any, src: str) -> None:
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf

    if not isinstance(prof, dict) or not isinstance(prof.get("kinds", {}), dict) or not all(
            isinstance(v, dict) for v in prof.get("kinds", {}).values()):
        raise PlanError(f"profile {src} is not a JSON object of the profile's form")
    problems = [k for k in ("device", "measured", "kinds") if k not in prof]
    if not number(prof.get("index_ns_per_element")):
        problems.append("index_ns_per_element")
    if "index_fixed_ns" in prof and not number(prof["index_fixed_ns"]):
        problems.append("index_fixed_ns")
    if "width" in prof and not (number(prof["width"]) and prof["width"] > 0):
        problems.append("width")
    optional = ("walk_ns_per_element", "index_ns_per_element", "out_ns_per_element")
    for k in PROFILE_KINDS:
        entry = prof.get("kinds", {}).get(k, {})
        problems += [f"kinds.{k}.{f}" for f in ("fixed_ns", "ns_per_element")
                     if not number(entry.get(f))]
        problems += [f"kinds.{k}.{f}" for f in optional if f in entry and not number(entry[f])]
        shapes = entry.get("shapes", {})
        if not isinstance(shapes, dict) or not all(isinstance(v, dict) for v in shapes.values()):
            problems.append(f"kinds.{k}.shapes")
            continue
        problems += [f"kinds.{k}.shapes.{s}.{f}" for s, v in shapes.items()
                     for f in ("fixed_ns", "ns_per_element", *optional)
                     if f in v and not number(v[f])]
        problems += [f"kinds.{k}.shapes.{s} (a tile shape such as 32x64)" for s in shapes
                     if not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*)+", s)]
        if "products" in entry:
            p = entry["products"]
            problems += [f"kinds.{k}.products.{f}" for f in ("ns_per_element",
                                                            "walk_ns_per_element")
                         if not isinstance(p, dict) or not number(p.get(f))]
            if isinstance(p, dict) and "out_ns_per_element" in p and not number(
                    p["out_ns_per_element"]):
                problems.append(f"kinds.{k}.products.out_ns_per_element")
    zeros = prof.get("kinds", {}).get("dense", {}).get("zeros_discount", 0.0)
    if not (number(zeros) and zeros < 1):
        problems.append("kinds.dense.zeros_discount (a fraction below 1)")
    if problems:
        raise PlanError(f"profile {src} lacks or has invalid: {', '.join(problems)}")


# -- tiles ------------------------------------------------------------------------------------

def batch_axes(op: Operator) -> tuple[str, ...]:
    """Axes in every access (output included) of a product of several inputs: independent
    problems (batched matmul's b, MoE's e), never worth tiling. None for a single input or a
    pure elementwise product, where every axis would qualify and nothing would be left to tile."""
    accs = (op.output, *op.inputs)
    batch = tuple(a for a in op.axes if all(a in acc.axes for acc in accs))
    return batch if len(op.inputs) > 1 and len(batch) < len(op.axes) else ()


TileSpec = str | Sequence[int] | Mapping[str, int] | None


def parse_tile(op: Operator, tile: TileSpec) -> dict[str, int]:
    """The compute tile as {axis: extent}: defaults 1 on batch axes, 64 on other spatial axes,
    32 on reduction axes; ``tile`` as "64x64x32" or a sequence (both in ``op.axes`` order) or a
    dict overriding some axes."""
    batch = batch_axes(op)
    out = {a: 1 if a in batch else 64 if a in op.spatial_axes else 32 for a in op.axes}
    if tile is None:
        return out
    order = f"{len(op.axes)} extents in axis order {'x'.join(op.axes)}"
    if not isinstance(tile, (str, Sequence, Mapping, np.ndarray)):
        raise PlanError(f"tile must be a string such as '64x64x32', a sequence of {order} or a "
                        f"dict by axis; got {tile!r}")
    if isinstance(tile, str):
        parts = [p for p in re.split(r"[x,\s]+", tile.strip()) if p]
        if not all(re.fullmatch(r"[0-9]+", p) for p in parts):
            example = "x".join(map(str, out.values()))
            raise PlanError(f"tile {tile!r}: expected {order}, e.g. {example}")
        tile = [int(p) for p in parts]
    if isinstance(tile, Mapping):
        unknown = [a for a in tile if a not in out]
        if unknown:
            raise PlanError(f"tile names {unknown}, which are not axes of {op.text!r} "
                            f"(axes: {', '.join(op.axes)})")
        given = dict(tile)
    else:
        values = list(tile)
        if len(values) != len(op.axes):
            raise PlanError(f"tile has {len(values)} extents, expected {order}")
        given = dict(zip(op.axes, values))
    for a, v in given.items():
        out[a] = checks.integer(v, f"tile extent of {a}", maximum=INT32_MAX, error=PlanError)
    return out


def _span(e: sympy.Expr, tile: Mapping[str, int]) -> int:
    """Extent along a dimension indexed by ``e`` covered by one compute tile (with halo)."""
    return 1 + sum(abs(int(e.coeff(s))) * (tile[s.name] - 1) for s in e.free_symbols)


def _dense_shape(acc: Access, tile: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(_span(e, tile) for e in acc.indices)


def _micro_axes(op: Operator, acc: Access, rules: Rules) -> list[str]:
    """Axes a micro-tile of S can be 1 along: invariant, a bare index of a single dim of S, and
    not a batch axis (a batch axis is already tiled by 1)."""
    batch = batch_axes(op)
    return [a for a in acc.axes if rules.axes[a].invariant and a not in batch
            and acc.bare_dim(a) is not None and len(acc.dims_of(a)) == 1]


def _batch_dims(op: Operator, acc: Access) -> set[int]:
    return {d for a in batch_axes(op) if (d := acc.bare_dim(a)) is not None}


Spec = tuple[str, str | None, tuple[int, ...]]  # (kind, axis, shape)


def _shapes(op: Operator, acc: Access, rules: Rules) -> list[Spec]:
    """(kind, axis, shape) of every micro-tile and block of S, before clipping to S's shape."""
    batch = _batch_dims(op, acc)
    sizes = [(1,) if d in batch else TILE_SIZES for d in range(acc.rank)]
    out = []
    for a in _micro_axes(op, acc, rules):
        d = acc.bare_dim(a)
        out += [("micro", a, s) for s in itertools.product(*(sizes[:d] + [(1,)] + sizes[d + 1:]))]
    out += [("block", None, s) for s in itertools.product(*sizes)]
    return out


# -- costing ----------------------------------------------------------------------------------

#: What a candidate's cost depends on: (non-zero micro-tiles/blocks, dense tiles after packing,
#: elements of S inside the non-zero tiles, edge tiles clipped). The GPU planner
#: (``coverage.py``) reduces the same three numbers on the device.
Counts = tuple[int, int, int]


class _Stats:
    """Counts on one S (its mask, or all ones of a shape) shared by all its candidates."""

    def __init__(self, mask: np.ndarray | None, shape: tuple[int, ...]):
        self.mask, self.shape = mask, shape
        self.cache: dict = {}

    def counts(self, spec: Spec, packing: tuple[int, int], acc: Access) -> Counts:
        kind, axis, tile = spec
        if self.mask is None:
            return self._dense_counts(spec, packing, acc)
        grid = tile_grid(self.mask, tile, self.cache)
        nonzero = int(np.count_nonzero(grid))
        covered = grid.astype(np.int64)
        for n, t in zip(self.shape, tile):
            covered = np.tensordot(tile_extents(n, t), covered, axes=([0], [0]))
        if kind == "micro":
            chunk, run = packing
            along = np.moveaxis(grid, acc.bare_dim(axis), -1)
            pad = -along.shape[-1] % run
            runs = np.pad(along, [(0, 0)] * (along.ndim - 1) + [(0, pad)])
            per_run = runs.reshape(*runs.shape[:-1], -1, run).sum(axis=-1)
            dense_tiles = int(np.sum(-(-per_run // chunk)))
        else:
            dense_tiles = grid.size if kind == "dense" else nonzero
        return nonzero, dense_tiles, int(covered)

    def _dense_counts(self, spec: Spec, packing: tuple[int, int], acc: Access) -> Counts:
        """The counts of an all-ones S, in closed form: a shape planned without a mask may be
        far larger than memory (every tile holds a non-zero; the tiles cover S once)."""
        kind, axis, tile = spec
        grid = [-(-n // t) for n, t in zip(self.shape, tile)]
        nonzero = math.prod(grid)
        if kind == "micro":
            (chunk, run), g = packing, grid[acc.bare_dim(axis)]
            dense_tiles = nonzero // g * (g // run * -(-run // chunk) + -(-(g % run) // chunk))
        else:
            dense_tiles = nonzero
        return nonzero, dense_tiles, math.prod(self.shape)


def _packing(spec: Spec, acc: Access, rules: Rules, tile: Mapping[str, int],
             size: Sequence[int]) -> tuple[int, int]:
    """(micro-tiles packed per dense tile, the run of S along the micro axis they are packed
    within): the compute tile's extent along the micro axis; along a spatial axis within each
    row block of the row-owner kernel (its steps), along a reduction axis within the whole axis."""
    kind, axis, _ = spec
    if kind != "micro":
        return 1, 1
    n = size[acc.bare_dim(axis)]
    return min(tile[axis], n), rows_block(n) if rules.axes[axis].role == "spatial" else n


def _shape_rates(kind: Mapping, shape: Sequence[int]) -> Mapping:
    """A kind's rates for one tile shape: its own where measured, else those of the measured
    shape nearest to it (the sum of its extents' log ratios), the slowest on a tie: each extent
    can pick the kernel (wgmma takes blocks of 64 or 128 rows and whole 64-deep k-tiles, others
    run on mma.sync), so an unmeasured shape is priced as its slowest plausible kernel. Not the
    kind's fit over all shapes, which priced 32 x 128 blocks at 0.0068 ns an element where the
    measured 32 x 64 costs 0.058 (H200)."""
    shapes = kind.get("shapes", {})
    own = shapes.get("x".join(map(str, shape)))
    if own is not None or not shapes:
        return {**kind, **(own or {})}

    def distance(name: str) -> tuple[float, float]:
        dims = [int(d) for d in name.split("x")]
        return (round(sum(abs(math.log(d / t)) for d, t in zip(dims, shape)), 9),
                -shapes[name]["ns_per_element"])

    return {**kind, **shapes[min(shapes, key=distance)]}


def _costed(spec: Spec, counts: Counts, nnz: int, size: Sequence[int], chunk: int,
            rules: Rules, profile: Mapping, extent: int = 0, scale: float = 1.0,
            outputs: float = 0.0) -> Candidate:
    """A candidate from its counts. Work is counted in elements of S computed: dense and block
    tiles clipped at S's edges; a micro candidate's dense tile along a reduction axis always
    counts its full extent (the last chunk of a group is padded with unused slots); along a
    spatial axis the micro-tiles themselves, beside its dense tiles (the row-owner kernel's
    steps, each of which costs about the same whatever it holds). A spatial micro-tile that fits the
    products kernel (``lower.products_fit`` over ``extent``, S's extent along the micro axis)
    may run on it instead of the row-owner one, where the profile prices it (``products``); the
    cheaper of the two counts. ``scale``: the product's width over the profile's (the kernels'
    work and walk grow with it; the index pass reads S alone). ``outputs``: elements of the
    product written (S's rows times its width), priced apart from S's elements: per element of
    S, a 768-deep product writes 5.3 times what the 4096-deep profile did (BERT's 768 -> 768
    layer, 16 K tokens: 128 x 128 blocks priced 20 us, measured 35)."""
    kind, axis, shape = spec
    nonzero, dense_tiles, covered = counts
    total = math.prod(size)
    if kind == "micro":
        key = f"micro-{rules.axes[axis].role}"
        elements = covered if key == "micro-spatial" else dense_tiles * math.prod(shape) * chunk
    elif kind == "block":
        key, elements = kind, covered
    else:  # dense computes (and wastes) all of S, zero tiles included
        key, elements = kind, total
        covered = total
        # ... and runs faster on zeros: tensor cores draw less power, so the clock holds higher
        elements *= 1.0 - profile["kinds"]["dense"].get("zeros_discount", 0.0) * (
            1.0 - nnz / total if total else 0.0)
    # a shape measured on its own overrides its kind's fit (one kind may run on two mainloops:
    # 32 x 32 blocks on mma.sync, 128 x 128 on wgmma), and a kind's index its profile's
    k = _shape_rates(profile["kinds"][key], shape)
    cost = (scale * (dense_tiles * k["fixed_ns"] + elements * k["ns_per_element"])
            + outputs * k.get("out_ns_per_element", 0.0))
    if kind != "dense":
        # the index pass (its launch, and its read of S), and the part of the kernel that visits
        # all of S whatever its density (the row-owner kernel walks every k-tile of every row
        # block: optional, default 0)
        index = profile.get("index_fixed_ns", 0.0) + total * k.get(
            "index_ns_per_element", profile["index_ns_per_element"])
        cost += index + scale * total * k.get("walk_ns_per_element", 0.0)
        p = profile["kinds"][key].get("products")
        if (p is not None and products_fit(nonzero, extent)
                and math.prod(shape) in PRODUCTS_EXTENTS and 1 in shape):
            cost = min(cost, index + scale * (elements * p["ns_per_element"]
                                              + total * p["walk_ns_per_element"])
                       + outputs * p.get("out_ns_per_element", 0.0))
    waste = (covered - nnz) / nnz if nnz else (0.0 if covered == 0 else None)
    return Candidate(kind, axis, shape, nonzero, waste, dense_tiles, float(cost))


def _nominal_shape(op: Operator, acc: Access, tile: Mapping[str, int]) -> tuple[int, ...]:
    """Without a mask: batch dims 1, others the compute tile's span rounded up to a multiple of
    the largest tile tried (so that every tried extent divides it)."""
    batch = _batch_dims(op, acc)
    top = TILE_SIZES[-1]
    return tuple(1 if d in batch else -(-t // top) * top
                 for d, t in enumerate(_dense_shape(acc, tile)))


def _specs(op: Operator, acc: Access, rules: Rules, tile: Mapping[str, int],
           size: Sequence[int] | None) -> list[Spec]:
    """Micro-tiles, blocks, then the dense compute tile; clipped to ``size`` when S's real
    shape is known (deduplicated: extents past the edge change nothing)."""
    clip = (lambda s: tuple(min(t, n) for t, n in zip(s, size))) if size else tuple
    specs = [(k, a, clip(s)) for k, a, s in _shapes(op, acc, rules)]
    specs.append(("dense", None, clip(_dense_shape(acc, tile))))
    return list(dict.fromkeys(specs))


def candidate_specs(op: Operator | str, sparse: str, shape: Sequence[int],
                    tile: TileSpec = None) -> list[Spec]:
    """The (kind, axis, shape) of every candidate :func:`make_plan` costs for ``sparse`` of
    ``shape``: what a planner that counts elsewhere (on the GPU) must count, keyed the same
    way in ``make_plan(coverage=...)``."""
    return [s for s, _, _ in candidate_counting(op, sparse, shape, tile)]


def candidate_counting(op: Operator | str, sparse: str, shape: Sequence[int],
                       tile: TileSpec = None) -> list[tuple[Spec, int | None, tuple[int, int]]]:
    """Each spec of :func:`candidate_specs` with how its dense tiles are counted: S's dim of
    its micro axis (None for blocks and dense) and (micro-tiles per dense tile, the run of that
    dim they are packed within)."""
    op = as_operator(op)
    acc = sparse_access(op, sparse)
    size = checks.extents(shape, f"shape of {acc.tensor}", rank=acc.rank, error=PlanError)
    rules, tile_map = analyse(op), parse_tile(op, tile)
    return [(s, acc.bare_dim(s[1]) if s[0] == "micro" else None,
             _packing(s, acc, rules, tile_map, size))
            for s in _specs(op, acc, rules, tile_map, size)]


def list_candidates(op: Operator | str, sparse: str, tile: TileSpec = None, *,
                    mask: np.ndarray | None = None, shape: Sequence[int] | None = None,
                    profile: str | os.PathLike | Mapping | None = None) -> list[Candidate]:
    """Every micro-tile, block and the dense candidate of ``sparse``, costed on ``mask`` (or
    at density 1 on ``shape``, or on a nominal shape), cheapest first."""
    plan = make_plan(op, sparse, mask=mask, tile=tile, profile=profile, shape=shape)
    return list(plan.candidates)


def _parse_micro_tile(micro_tile: Any) -> str | tuple[int, ...] | Candidate:
    if isinstance(micro_tile, Candidate):
        return micro_tile
    if not (micro_tile is None or isinstance(micro_tile, (str, Sequence, np.ndarray))):
        raise PlanError(f"micro_tile must be 'auto', 'dense', a shape such as '32x1' or (32, 1), "
                        f"or a Candidate; got {micro_tile!r}")
    if micro_tile is None or (isinstance(micro_tile, str) and micro_tile.strip() == "auto"):
        return "auto"
    if isinstance(micro_tile, str):
        if micro_tile.strip() == "dense":
            return "dense"
        parts = [p for p in re.split(r"[x,\s]+", micro_tile.strip()) if p]
        if not parts or not all(re.fullmatch(r"[0-9]+", p) for p in parts):
            raise PlanError(f"micro_tile {micro_tile!r}: expected 'auto', 'dense' or a shape "
                            f"like 32x1")
        micro_tile = [int(p) for p in parts]
    values = tuple(micro_tile)
    if not values or any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))
                         or not 1 <= v <= INT32_MAX for v in values):
        raise PlanError(f"micro_tile {micro_tile!r}: extents must be positive integers (at most {INT32_MAX})")
    return tuple(int(v) for v in values)


def _requested(op: Operator, acc: Access, rules: Rules, want: tuple[int, ...] | Candidate,
               size: tuple[int, ...]) -> tuple[str, str | None, tuple[int, ...]]:
    """(kind, axis, shape) of an explicit request (a shape, or a Candidate naming its axis);
    RuleError if its 1 is along a non-invariant axis, PlanError if it is no micro-tile or block
    of S."""
    shape = tuple(want.shape) if isinstance(want, Candidate) else want
    if len(shape) != acc.rank:
        raise PlanError(f"micro_tile {list(shape)} has {len(shape)} extents but {acc} has rank "
                        f"{acc.rank}: neither a micro-tile nor a block of {acc.tensor}")
    if isinstance(want, Candidate) and want.kind != "micro":
        if want.kind not in KIND_RANK:
            raise PlanError(f"unknown candidate kind {want.kind!r}")
        return want.kind, None, shape
    if isinstance(want, Candidate):
        rules.require_invariant(want.axis)
        ones = [d for d in acc.dims_of(want.axis) if shape[d] == 1]
        if not ones:
            raise PlanError(f"micro-tile {list(shape)} is not 1 along {want.axis} in {acc}")
    else:
        batch = _batch_dims(op, acc)
        ones = [d for d, t in enumerate(shape) if t == 1 and d not in batch and size[d] > 1]
        if not ones:
            return "block", None, shape
    if len(ones) > 1:
        usable = _micro_axes(op, acc, rules)
        ones = [d for d in ones if str(acc.indices[d]) in usable] or ones
        if len(ones) > 1:
            raise PlanError(f"micro_tile {list(shape)} is 1 along several dims of {acc} "
                            f"({', '.join(str(acc.indices[d]) for d in ones)}): ambiguous; pass "
                            f"a Candidate to name the axis")
    e = acc.indices[ones[0]]
    if not isinstance(e, sympy.Symbol):
        names = {s.name for s in e.free_symbols}
        why = "; ".join(f"{a}: {rules.axes[a].reason}" for a in op.axes
                        if a in names and not rules.axes[a].invariant)
        raise RuleError(f"micro_tile {list(shape)} is 1 along dimension {ones[0]} of {acc}, "
                        f"indexed by {e}: not a single permutation invariant axis"
                        + (f" ({why})" if why else ""))
    rules.require_invariant(e.name)
    if len(acc.dims_of(e.name)) != 1:
        raise RuleError(f"{e.name} indexes several dimensions of {acc}: a micro-tile along it "
                        f"would not be a slice")
    return "micro", e.name, shape


def _coverage(coverage: Any, specs: Sequence[Spec], size: Sequence[int]
              ) -> tuple[int, dict[Spec, Counts]]:
    """(nnz, counts per spec) of ``coverage``, each a non-negative integer within S's size."""
    total = math.prod(size)
    if not isinstance(coverage, Mapping) or not isinstance(coverage.get("counts"), Mapping):
        raise PlanError("coverage must be a dict {'counts': {spec: (nonzero, dense_tiles, "
                        "covered)}, 'nnz': int}")
    missing = [s for s in specs if s not in coverage["counts"]]
    if missing:
        raise PlanError(f"coverage counts lack candidates {missing[:3]}")
    nnz = checks.integer(coverage.get("nnz"), "coverage['nnz']", minimum=0, maximum=total,
                         error=PlanError)
    counts = {}
    for s in specs:
        c = coverage["counts"][s]
        if isinstance(c, (str, bytes)) or not isinstance(c, (Sequence, np.ndarray)) or len(c) != 3:
            raise PlanError(f"coverage counts of {s} must be (nonzero, dense_tiles, covered), "
                            f"got {c!r}")
        counts[s] = tuple(checks.integer(v, f"coverage count of {s}", minimum=0, error=PlanError)
                          for v in c)
    return nnz, counts


def make_plan(op: Operator | str, sparse: str, mask: np.ndarray | None = None,
              tile: TileSpec = None,
              micro_tile: str | Sequence[int] | Candidate | None = None,
              profile: str | os.PathLike | Mapping | None = None,
              shape: Sequence[int] | None = None,
              coverage: Mapping | None = None, width: int | None = None) -> Plan:
    """Cost every candidate of ``sparse`` on ``mask`` and choose the cheapest (ties: dense, then
    block, then micro), unless it saves less than ``DENSE_MARGIN`` of dense's price. Without a
    mask the plan is dense (nothing known to skip) unless ``micro_tile`` asks otherwise: 'auto'
    (default), 'dense', a shape in S's dim order such as (32, 1) or "32x1", or a
    :class:`Candidate` (its kind, axis and shape are used).

    ``shape`` is S's shape when known without a mask (or to check the mask against);
    ``coverage`` replaces the mask by counts made elsewhere (on the GPU):
    ``{"counts": {spec: (nonzero, dense_tiles, covered)}, "nnz": int}`` for every spec of
    :func:`candidate_specs`, with ``shape`` given. ``width``: how many outputs each element of
    S meets (N of a matrix product), when known; the profile's times are at its own ``width``
    (4096 unless it says), and a narrower product makes every kernel cheaper beside the index
    pass (BERT's 768 -> 768 layer: dense cuBLAS 12 us, not the 35 a 4096-wide B would take)."""
    op = as_operator(op)
    rules = analyse(op)
    acc = sparse_access(op, sparse)
    tile = parse_tile(op, tile)
    prof = load_profile(profile)
    want = _parse_micro_tile(micro_tile)
    if mask is not None:
        if coverage is not None:
            raise PlanError("give a mask or coverage counts, not both")
        mask = as_mask(mask, acc)
        if shape is not None and checks.extents(shape, "shape", error=PlanError) != mask.shape:
            raise PlanError(f"mask has shape {mask.shape} but {acc.tensor} has shape "
                            f"{tuple(shape)}")
        size = tuple(int(n) for n in mask.shape)
    elif shape is not None:
        size = checks.extents(shape, f"shape of {acc.tensor}", rank=acc.rank, error=PlanError)
    elif coverage is not None:
        raise PlanError("coverage counts need the operand's shape")
    else:
        size = _nominal_shape(op, acc, tile)
    real = mask is not None or shape is not None
    measured = mask is not None or coverage is not None
    specs = _specs(op, acc, rules, tile, size if real else None)
    chosen = dense = specs[-1]
    if not isinstance(want, str):
        kind, axis, req = _requested(op, acc, rules, want, size)
        if kind != "dense":
            chosen = (kind, axis, tuple(min(t, n) for t, n in zip(req, size)) if real else req)
            specs += [chosen] if chosen not in specs else []
    packing = {s: _packing(s, acc, rules, tile, size) for s in specs}
    if coverage is not None:
        nnz, counts = _coverage(coverage, specs, size)
    else:
        stats = _Stats(mask, size)
        nnz = int(np.count_nonzero(mask)) if mask is not None else math.prod(size)
        counts = {s: stats.counts(s, packing[s], acc) for s in specs}
    if width is not None and (isinstance(width, bool) or not isinstance(width, (int, np.integer))
                              or width < 1):
        raise PlanError(f"width must be a positive integer (the product's N), got {width!r}")
    full = prof.get("width", PROFILE_WIDTH)
    scale = width / full if width is not None else 1.0
    # S's rows: its extents along dimensions that no reduction axis indexes (A[m,k]: M)
    rows = math.prod(n for d, n in enumerate(size) if not any(
        rules.axes[a].role == "reduction" for a in op.axes if d in acc.dims_of(a)))
    outputs = rows * (width if width is not None else full)
    cands = {s: _costed(s, counts[s], nnz, size, packing[s][0], rules, prof,
                        size[acc.bare_dim(s[1])] if s[0] == "micro" else 0, scale, outputs)
             for s in specs}
    ordered = sorted(cands.values(), key=lambda c: (c.cost, KIND_RANK[c.kind]))
    choice = ordered[0] if want == "auto" and measured else cands[chosen]
    if want == "auto" and measured and choice.cost > (1 - DENSE_MARGIN) * cands[dense].cost:
        choice = cands[dense]
    return Plan(op, rules, sparse, tile, choice, tuple(ordered), prof, size, measured)
