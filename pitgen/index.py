"""The NumPy reference of PIT's online sparsity index.

At run time the GPU scans the sparse operand S once and, for every *group* (a tile of S's
dimensions other than the *list dimension*), records how many micro-tiles (or blocks) along the
list dimension hold a non-zero, and which ones. The dense kernel then packs each list into
dense tiles. Lists are unordered: PIT's point is that any order gives the same result, so the
GPU may build them with atomics; compare indexes with :meth:`TileIndex.sets`, never ``ids``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from . import checks
from .errors import PlanError
from .expr import Access, Operator, as_operator

if TYPE_CHECKING:
    from .planner import Candidate, Plan


def sparse_access(op: Operator, sparse: str) -> Access:
    """The single input access of ``sparse``; PIT gathers one operand, read once."""
    if sparse not in op.input_names:
        raise PlanError(f"{sparse!r} is not an input of {op.text!r} "
                        f"(operands: {', '.join(op.input_names)})")
    accs = [a for a in op.inputs if a.tensor == sparse]
    if len(accs) != 1:
        raise PlanError(f"{sparse} is read {len(accs)} times in {op.text!r}: the sparse operand "
                        f"must appear once so that skipping its zeros skips whole products")
    return accs[0]


def list_dim(op: Operator, acc: Access) -> int:
    """List dimension of a block (or dense) index: S's first bare reduction dimension, so that a
    group's blocks accumulate into the same outputs; S's last dimension otherwise."""
    for a in op.reduction_axes:
        d = acc.bare_dim(a)
        if d is not None:
            return d
    return acc.rank - 1


def as_mask(mask: np.ndarray, acc: Access) -> np.ndarray:
    """``mask`` as a boolean array (non-zero = True) of ``acc``'s rank."""
    m = checks.numeric_array(mask, f"mask of {acc.tensor}", error=PlanError)
    if m.dtype != np.bool_:
        m = m != 0
    if m.ndim != acc.rank:
        raise PlanError(f"mask has shape {m.shape} (rank {m.ndim}) but {acc} has rank {acc.rank}")
    if 0 in m.shape:
        raise PlanError(f"mask of {acc.tensor} has an empty dimension: shape {m.shape}")
    return m


def tile_extents(size: int, t: int) -> np.ndarray:
    """Extent of each tile of ``t`` along a dimension of ``size`` (the last one clipped)."""
    return np.minimum(t, size - np.arange(0, size, t))


def _any_groups(grid: np.ndarray, d: int, f: int) -> np.ndarray:
    """OR of each run of ``f`` entries along ``d`` (the last run may be shorter)."""
    n = grid.shape[d]
    if f == 1 or n == 1:
        return grid
    full = n // f * f
    parts = []
    if full:
        head = grid[(slice(None),) * d + (slice(0, full),)]
        split = grid.shape[:d] + (n // f, f) + grid.shape[d + 1:]
        parts.append(head.reshape(split).any(axis=d + 1))
    if full < n:
        parts.append(grid[(slice(None),) * d + (slice(full, n),)].any(axis=d, keepdims=True))
    return np.concatenate(parts, axis=d) if len(parts) > 1 else parts[0]


def tile_grid(mask: np.ndarray, tile: Sequence[int], cache: dict | None = None) -> np.ndarray:
    """Boolean grid: does tile ``g`` (tiles of ``tile``, edge tiles clipped) hold a non-zero?

    Reduces one dimension at a time (reshape + any, no padding of the mask). ``cache`` keeps
    the partial grids keyed by tile prefix, and a tile of ``t`` is built from a cached tile of
    a divisor of ``t`` (tile boundaries align), so planning all candidates of an operand reads
    the full mask only a few times.
    """
    grid = mask
    for d, t in enumerate(tile):
        key = tuple(tile[:d]) + (t,)
        if cache is not None and key in cache:
            grid = cache[key]
            continue
        base, f = grid, t
        if cache is not None:
            divs = [u for u in range(t - 1, 0, -1) if t % u == 0 and key[:-1] + (u,) in cache]
            if divs:
                base, f = cache[key[:-1] + (divs[0],)], t // divs[0]
        grid = _any_groups(base, d, f)
        if cache is not None:
            cache[key] = grid
    return grid


@dataclass(frozen=True, eq=False)
class TileIndex:
    """Per group (tile of S's dims other than ``dim``): ``counts`` non-zero micro-tiles/blocks,
    ``ids`` their positions along ``dim`` (in tile units; -1 beyond ``counts``).

    ``tile`` is the extent of one micro-tile/block in S's dimension order (1 at ``dim`` for a
    micro-tile), clipped to ``shape``; ``ids`` has shape ``counts.shape + (tiles along dim,)``.
    """

    kind: str  # 'micro' | 'block' | 'dense'
    axis: str | None
    dim: int
    shape: tuple[int, ...]
    tile: tuple[int, ...]
    counts: np.ndarray
    ids: np.ndarray

    @property
    def other_dims(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.shape)) if i != self.dim)

    @property
    def nonzero(self) -> int:
        return int(self.counts.sum())

    def sets(self) -> dict[tuple[int, ...], frozenset[int]]:
        """Every group's list as a set: the order-free content to compare indexes by."""
        return {g: frozenset(int(i) for i in self.ids[g][:self.counts[g]])
                for g in np.ndindex(self.counts.shape)}

    def group_box(self, group: tuple[int, ...]) -> list[tuple[int, int]]:
        """Element range of ``group`` on each of S's dims (the list dim spans everything)."""
        box = [(0, n) for n in self.shape]
        for g, d in zip(group, self.other_dims):
            lo = g * self.tile[d]
            box[d] = (lo, min(lo + self.tile[d], self.shape[d]))
        return box

    def groups(self) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
        """(group, its ids) for each group with at least one id."""
        for g in np.ndindex(self.counts.shape):
            if self.counts[g]:
                yield g, self.ids[g][:self.counts[g]]


def _lists(grid: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """counts and -1-padded ids of the True entries of ``grid`` along ``dim``."""
    g = np.moveaxis(grid, dim, -1)
    counts = g.sum(axis=-1, dtype=np.int32)
    order = np.argsort(~g, axis=-1, kind="stable").astype(np.int32)
    ids = np.where(np.arange(g.shape[-1]) < counts[..., None], order, np.int32(-1))
    return counts, ids.astype(np.int32)


def build_index(mask: np.ndarray, op: Operator | str, sparse: str,
                candidate_or_plan: "Candidate | Plan") -> TileIndex:
    """Index ``mask`` (S's non-zeros) for a micro, block or dense candidate (or a plan's choice)."""
    cand = getattr(candidate_or_plan, "choice", candidate_or_plan)
    if not all(hasattr(cand, a) for a in ("kind", "axis", "shape")):
        raise PlanError(f"build_index needs a Candidate or a Plan, got "
                        f"{type(candidate_or_plan).__name__}")
    op = as_operator(op)
    acc = sparse_access(op, sparse)
    mask = as_mask(mask, acc)
    shape = tuple(int(n) for n in mask.shape)
    if cand.kind == "dense":
        dim = list_dim(op, acc)
        grid = (1,) * (len(shape) - 1)
        return TileIndex("dense", None, dim, shape, shape, np.ones(grid, np.int32),
                         np.zeros(grid + (1,), np.int32))
    if len(cand.shape) != len(shape):
        raise PlanError(f"candidate shape {list(cand.shape)} does not fit mask shape {shape}")
    tile = tuple(max(1, min(t, n)) for t, n in zip(cand.shape, shape))
    if cand.kind == "micro":
        dim = acc.bare_dim(cand.axis)
        if dim is None or tile[dim] != 1:
            raise PlanError(f"micro-tile {list(cand.shape)} is not 1 along {cand.axis} in {acc}")
    elif cand.kind == "block":
        dim = list_dim(op, acc)
    else:
        raise PlanError(f"unknown candidate kind {cand.kind!r}")
    counts, ids = _lists(tile_grid(mask, tile), dim)
    return TileIndex(cand.kind, cand.axis, dim, shape, tile, counts, ids)
