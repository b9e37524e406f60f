"""NumPy references: :func:`evaluate` computes an operator densely; :func:`execute` follows a
plan step by step the way the generated kernel will (index, SRead gather, dense tile compute,
SWrite scatter / accumulate), so that each step can be checked on the CPU.

Both compute in float64 (or ``dtype``) whatever the inputs' dtype: they are the references the
GPU results are compared against, so rounding must come from the GPU side only.
"""
from __future__ import annotations

import math
import string
from typing import Any, Mapping, Sequence

import numpy as np
import sympy

from . import checks
from .errors import PlanError, ShapeError
from .expr import EPILOGUES, Access, Operator, as_operator
from .index import TileIndex, build_index, sparse_access
from .planner import Plan

_LETTERS = string.ascii_letters

#: One axis' part of a tile: a contiguous range, or gathered ids (SRead).
Selection = slice | np.ndarray
#: A restriction to S's tile on a dim indexed by an affine expression: (axes, bool array).
Indicator = tuple[tuple[str, ...], np.ndarray]


def _broadcast(op: Operator, axes: Sequence[str], a: np.ndarray) -> np.ndarray:
    """``a`` (one dim per axis in ``axes``) reshaped to broadcast over all of ``op.axes``."""
    order = sorted(range(len(axes)), key=lambda i: op.axes.index(axes[i]))
    a = np.transpose(a, order)
    shape = [1] * len(op.axes)
    for j, i in enumerate(order):
        shape[op.axes.index(axes[i])] = a.shape[j]
    return a.reshape(shape)


def _compute(op: Operator, views: Sequence[np.ndarray], inds: Sequence[Indicator],
             dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """The operator on (sub-)views, one per input access, restricted by ``inds``.

    Returns (value, coverage): for max/min, coverage counts the reduction positions computed
    per output (value holds the reducer's identity where none was); for '=', where outputs were
    computed (None: all); for sum, None (skipped terms add nothing).
    """
    letters = dict(zip(op.axes, _LETTERS))
    ops = [v.astype(dtype, copy=False) for v in views]
    if op.reducer == "sum":
        terms = [(acc.axes, v) for acc, v in zip(op.inputs, ops)] + [
            (axes, ind.astype(dtype)) for axes, ind in inds]
        spec = ",".join("".join(letters[a] for a in axes) for axes, _ in terms)
        out = "".join(letters[a] for a in op.output.axes)
        return np.einsum(f"{spec}->{out}", *(v for _, v in terms), optimize=len(terms) > 2), None
    prod = math.prod(_broadcast(op, acc.axes, v) for acc, v in zip(op.inputs, ops))
    keep = None
    for axes, ind in inds:
        b = _broadcast(op, axes, ind)
        keep = b if keep is None else keep & b
    full = np.broadcast_to(prod, tuple(_extents_of(op, views).values()))
    if op.reducer == "none":
        value = EPILOGUES[op.epilogue](full) if op.epilogue else full
        return value, None if keep is None else np.broadcast_to(keep, value.shape)
    red = tuple(range(len(op.spatial_axes), len(op.axes)))
    ident = -np.inf if op.reducer == "max" else np.inf
    if keep is not None:
        full = np.where(keep, full, ident)
    value = full.max(axis=red) if op.reducer == "max" else full.min(axis=red)
    if keep is None:
        cover = np.full(value.shape, math.prod(full.shape[i] for i in red), np.int64)
    else:
        cover = np.broadcast_to(keep, full.shape).sum(axis=red)
    return value, cover


def _extents_of(op: Operator, views: Sequence[np.ndarray]) -> dict[str, int]:
    """Axis extents of a set of (sub-)views, in ``op.axes`` order."""
    ext: dict[str, int] = {}
    for acc, v in zip(op.inputs, views):
        ext.update(zip(acc.axes, v.shape))
    return {a: ext[a] for a in op.axes}


def _views(op: Operator,
           arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, int], list[np.ndarray]]:
    """Axis extents and one strided view per input access."""
    if not isinstance(arrays, Mapping):
        raise ShapeError(f"arrays must be a dict of input arrays by tensor name, got "
                         f"{type(arrays).__name__}")
    missing = [t for t in op.input_names if t not in arrays]
    if missing:
        raise ShapeError(f"missing input arrays {missing} for {op.text!r}")
    arrays = {t: checks.numeric_array(arrays[t], f"input {t}") for t in op.input_names}
    ext = op.extents({t: a.shape for t, a in arrays.items()})
    return ext, [op.view(acc, arrays[acc.tensor], ext) for acc in op.inputs]


def _float_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a NumPy floating dtype: the references compute in one."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise ShapeError(f"dtype {dtype!r} is not a NumPy dtype: {e}") from None
    if dt.kind != "f":
        raise ShapeError(f"dtype must be a floating dtype (float64, float32, ...), got {dt}")
    return dt


def evaluate(op: Operator | str, arrays: Mapping[str, np.ndarray],
             dtype: Any = np.float64) -> np.ndarray:
    """The dense result of ``op`` on ``arrays`` (by tensor name), computed in ``dtype``; its
    shape is the output axes' extents in output order."""
    op, dtype = as_operator(op), _float_dtype(dtype)
    _, views = _views(op, arrays)
    value, _ = _compute(op, views, (), dtype)
    return np.ascontiguousarray(value, dtype=dtype)


class _Accumulator:
    """The output being assembled tile by tile, with what skipped (all-zero) tiles contribute:
    the expression's value at S = 0."""

    def __init__(self, op: Operator, ext: Mapping[str, int], dtype):
        self.op = op
        shape = tuple(ext[a] for a in op.output.axes)
        self.total = math.prod(ext[a] for a in op.reduction_axes)
        if op.reducer == "none":
            at_zero = EPILOGUES[op.epilogue](np.zeros((), dtype)) if op.epilogue else 0.0
            self.out = np.full(shape, at_zero, dtype)
        elif op.reducer == "sum":
            self.out = np.zeros(shape, dtype)
        else:
            self.out = np.full(shape, -np.inf if op.reducer == "max" else np.inf, dtype)
            self.cover = np.zeros(shape, np.int64)

    def add(self, where: tuple, value: np.ndarray, cover: np.ndarray | None) -> None:
        """SWrite: scatter a tile's outputs to their positions, combining with earlier tiles."""
        if self.op.reducer == "sum":
            self.out[where] += value
        elif self.op.reducer == "none":
            self.out[where] = value if cover is None else np.where(cover, value, self.out[where])
        else:
            fn = np.maximum if self.op.reducer == "max" else np.minimum
            self.out[where] = fn(self.out[where], value)
            self.cover[where] += cover

    def result(self) -> np.ndarray:
        if self.op.reducer in ("max", "min"):
            fn = np.maximum if self.op.reducer == "max" else np.minimum
            return np.where(self.cover < self.total, fn(self.out, 0.0), self.out)
        return self.out


def _affine(e: sympy.Expr) -> tuple[int, dict[str, int]]:
    syms = sorted(e.free_symbols, key=lambda s: s.name)
    return int(e.subs({s: 0 for s in syms})), {s.name: int(e.coeff(s)) for s in syms}


def _select(acc: Access, ext: Mapping[str, int], box: Sequence[tuple[int, int]],
            ids: tuple[str, np.ndarray] | None
            ) -> tuple[dict[str, Selection], list[Indicator]] | None:
    """Per-axis selections for S's element box (and gathered ``ids`` on one axis), plus
    indicators for dims of S indexed by affine expressions; None if the tile is empty."""
    lo = {a: 0 for a in ext}
    hi = dict(ext)
    for e, (b0, b1) in zip(acc.indices, box):
        if isinstance(e, sympy.Symbol):
            lo[e.name], hi[e.name] = max(lo[e.name], b0), min(hi[e.name], b1)
    if any(lo[a] >= hi[a] for a in ext):
        return None
    sel: dict[str, Selection] = {a: slice(lo[a], hi[a]) for a in ext}
    if ids is not None:
        sel[ids[0]] = ids[1]
    inds: list[Indicator] = []
    for e, (b0, b1) in zip(acc.indices, box):
        if isinstance(e, sympy.Symbol):
            continue
        const, coef = _affine(e)
        axes = tuple(coef)
        val = np.full((1,) * len(axes), const, np.int64)
        for i, a in enumerate(axes):
            pos = np.arange(ext[a])[sel[a]]
            val = val + coef[a] * pos.reshape((1,) * i + (-1,) + (1,) * (len(axes) - i - 1))
        ind = (val >= b0) & (val < b1)
        if not ind.any():
            return None
        if not ind.all():
            inds.append((axes, ind))
    return sel, inds


def _tile(op: Operator, views: Sequence[np.ndarray], sel: Mapping[str, Selection],
          inds: Sequence[Indicator], acc_out: _Accumulator, dtype) -> None:
    """SRead (gather/slice every input), dense compute, SWrite."""
    sub = [v[tuple(sel[a] for a in acc.axes)] for acc, v in zip(op.inputs, views)]
    value, cover = _compute(op, sub, inds, dtype)
    acc_out.add(tuple(sel[a] for a in op.output.axes), value, cover)


def _boxes(index: TileIndex, tile: Sequence[int]):
    """Element boxes over all of S's dims: the index's non-zero blocks (dense: every tile)."""
    if index.kind == "dense":
        grid = [-(-n // t) for n, t in zip(index.shape, tile)]
        for corner in np.ndindex(*grid):
            yield [(c * t, min(c * t + t, n)) for c, t, n in zip(corner, tile, index.shape)]
        return
    d, t, n = index.dim, index.tile[index.dim], index.shape[index.dim]
    for g, ids in index.groups():
        box = index.group_box(g)
        for i in ids:
            box[d] = (int(i) * t, min(int(i) * t + t, n))
            yield list(box)


def execute(plan: Plan, **arrays: np.ndarray) -> np.ndarray:
    """Run ``plan`` on ``arrays`` (inputs by tensor name) as the kernel will, in float64:
    index S's non-zeros, pack each group's non-zero micro-tiles into dense tiles of the compute
    tile's extent along the micro axis, compute them densely, scatter/accumulate the outputs;
    everything skipped contributes the expression's value at S = 0. Equals :func:`evaluate` up
    to rounding."""
    if not isinstance(plan, Plan):
        raise PlanError(f"execute needs a pitgen.Plan, got {type(plan).__name__}")
    op, dtype = plan.operator, np.float64
    acc = sparse_access(op, plan.sparse)
    ext, views = _views(op, arrays)
    index = build_index(np.asarray(arrays[plan.sparse]) != 0, op, plan.sparse, plan)
    out = _Accumulator(op, ext, dtype)
    if index.kind == "micro":
        chunk = plan.compute_tile[index.axis]
        for g, ids in index.groups():
            box = index.group_box(g)
            for c in range(0, len(ids), chunk):
                picked = _select(acc, ext, box, (index.axis, ids[c:c + chunk].astype(np.intp)))
                if picked is not None:
                    _tile(op, views, *picked, out, dtype)
    else:
        shape = tuple(min(t, n) for t, n in zip(plan.choice.shape, index.shape))
        for box in _boxes(index, shape):
            picked = _select(acc, ext, box, None)
            if picked is not None:
                _tile(op, views, *picked, out, dtype)
    return out.result()
