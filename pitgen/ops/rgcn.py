"""RGCN inference: ``Y[i,f] += A[r,i,j] * X[j,g] * W[r,g,f]`` over a relation-typed adjacency.

The rule engine says i is spatial and r, j, g are reduction axes, all permutation invariant.
That allows two orders, each composing all relations into one SpMM launch (SparseTIR's
horizontal fusion) with the dense transforms as one batched matmul:

* **transform-first**: r and j are gathered together. Each (relation, source column) pair that
  holds an edge becomes one compact row: XW = X[sources] @ W_r, then Y = B · XW, where
  B [rows x compact] merges every relation's edges row by row (one CSR).
* **aggregate-first**: the (relation, row) pairs that hold an edge are the work list, rows in
  any order (i is invariant; SRead), a pair with more than ``piece`` edges split into pieces
  of at most ``piece`` (j is a reduction axis: the pieces' sums add up to the pair's). H = C · X
  with C [compact x cols] the pieces' rows stacked relation-major, Z = H @ W_r, then the pieces
  go back to their rows and are summed in any order (SWrite; r is invariant): Y = S · Z with
  S [rows x compact] of ones. Pieces bound C's longest row, which bounds the SpMM: its one group
  of lanes per row gathers a row's entries one round trip after another.

The transform is one ``torch.bmm`` for every relation: each relation's compact rows are padded
to whole tiles of ``tile`` rows (padding rows are never read back), so tile t multiplies by
W[tiles[t]] — no loop over relations, no host sync (``torch._grouped_mm`` runs fp32 and fp16 as
one matmul per relation after copying the offsets to the host).

:func:`plan_rgcn` picks the order with a cost model (:func:`order_cost`: each kernel lasts the
longest of its bytes at the copy rate, its FLOPs at the dense rate and its longest row at the
per-entry latency) from the edges per relation, the longest row and the feature sizes; layouts
not composed yet are estimated. :func:`compose` builds an order's operands from typed COO, with
NumPy on the host or torch on the GPU (one algorithm: ``_NumPyOps`` and ``_TorchOps``); on the
GPU it synchronises twice (``torch.unique`` sizes the pairs, then the rows per relation size
the tiles) per graph and order. :func:`execute_rgcn` runs a plan's steps in float64 on the CPU;
:func:`rgcn` runs them on the GPU (SpMM under RGCN's rules, :func:`transform`);
:class:`RGCNConv` is the layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..errors import PlanError, ShapeError
from ..graph.device import VALUE_DTYPES, DeviceCSR
from ..graph.formats import CSR, RGCN_EXPR, Relational, check_dense_operand, index_dtype
from ..graph.kernels import SPMM, spmm
from ..limits import INT32_MAX
from ..operands import check_tensor, on_operand_device
from ..opspec import OpSpec, Permutation
from ..reference import spmm_csr
from . import lazy_torch_classes

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["EXPR", "ORDERS", "RGCN", "Layout", "RGCNPlan", "plan_rgcn", "order_cost",
           "estimate_layout", "tile_rows", "piece_entries", "Composed", "compose",
           "execute_rgcn", "DeviceRelational", "transform", "rgcn"]

EXPR = RGCN_EXPR
TRANSFORM_FIRST, AGGREGATE_FIRST = ORDERS = ("transform-first", "aggregate-first")
#: Both orders run the CSR SpMM body over composed relations: rows (i) in any order, each
#: written to its own place, and a row's (relation, neighbour) terms gathered in any order.
RGCN = OpSpec("rgcn", "spmm.cu.j2", dict(SPMM.kernels),
              (Permutation("relation rows", EXPR, "spatial", "A"),
               Permutation("relations and neighbours", EXPR, "reduction", "A")),
              VALUE_DTYPES)

#: The cost model's device (H100 SXM): bytes at the copy rate, dense matmul FLOPs at torch's
#: rate per dtype (fp32 without TF32), a fixed cost per launch.
BYTES_PER_S = 2.5e12
FLOPS_PER_S = {"float16": 4.0e14, "float32": 5.0e13}
LAUNCH_S = 4e-6
#: Seconds per entry of a CSR SpMM's longest row: one group of lanes gathers a row's entries
#: two at a time, each pair a dependent round trip to memory, so no SpMM ends before its longest
#: row. Fitted to the H100 run of 2026-11-23 (docs/rgcn.md, "Measured": transform-first minus
#: aggregate-first on bgs and am, whose longest rows differ by 11k and 52k entries). fp16's is
#: the SpMM before commit debb742, whose fp16 gathers waited for each other: refit it next run.
ROW_ENTRY_S = {"float32": 3.0e-7, "float16": 5.5e-7}
INDEX_BYTES = 4
TAKE_BYTES = 8
#: Tile rows of the batched transform: powers of two between these.
TILE_ROWS = (16, 2048)
#: 2 x a typical feature size (64): the padding / weight-copy balance of :func:`tile_rows`.
TILE_BALANCE = 128
#: Entries per aggregate-first piece: powers of two between these.
PIECE_ENTRIES = (8, 4096)


def distinct_estimate(extent: int, draws: int) -> float:
    """Expected number of distinct values among ``draws`` uniform draws from ``extent``."""
    if extent <= 0 or draws <= 0:
        return 0.0
    return min(float(draws), extent * -math.expm1(-draws / extent))


def tile_rows(compact: int, relations: int) -> int:
    """Rows per tile of the batched transform for ``compact`` rows over ``relations`` non-empty
    relations. Padding costs about relations x tile / 2 rows, and every tile reads its own copy
    of W_r, compact / tile copies of F_in x F_out: sqrt(TILE_BALANCE x compact / relations)
    balances the two; the nearest power of two within TILE_ROWS."""
    if compact <= 0 or relations <= 0:
        return TILE_ROWS[0]
    t = 2 ** round(math.log2(math.sqrt(TILE_BALANCE * compact / relations)))
    return min(max(t, TILE_ROWS[0]), TILE_ROWS[1])


def piece_entries(row_max: int) -> int:
    """Entries per aggregate-first piece when a row holds at most ``row_max`` edges (all
    relations together): C's longest row is then at most the piece, and S's (the row's pieces)
    about relations + row_max / piece; a power of two at sqrt(row_max) or above balances them."""
    p = 1 << math.ceil(math.log2(math.sqrt(max(row_max, 1))))
    return min(max(p, PIECE_ENTRIES[0]), PIECE_ENTRIES[1])


@dataclass(frozen=True)
class Layout:
    """What one order runs: ``compact`` rows through the transform, padded per relation to
    ``tiles`` tiles of ``tile`` rows, and the longest row of each of its SpMMs in launch order
    (transform-first: B; aggregate-first: C, S)."""

    compact: int
    tile: int
    tiles: int
    longest: tuple[int, ...]

    @property
    def padded(self) -> int:
        return self.tile * self.tiles


def _tiled(counts: Sequence[int], longest: tuple[int, ...]) -> Layout:
    """The layout of compact rows ``counts`` per relation, tiled by :func:`tile_rows`."""
    compact = int(sum(counts))
    tile = tile_rows(compact, sum(1 for c in counts if c))
    return Layout(compact, tile, sum(-(-int(c) // tile) for c in counts), longest)


def estimate_layout(order: str, shape: Sequence[int], relation_nnz: Sequence[int], row_max: int,
                    piece: int) -> Layout:
    """An order's layout before composing: compact rows per relation as distinct draws
    (``n (1 - exp(-nnz_r / n))``), aggregate-first's extra pieces at most (nnz_r - pairs_r) /
    piece (none when no row is longer than a piece); the longest rows: B's is ``row_max``, C's
    the piece (``row_max`` unsplit), S's the longest row's relations (its edges drawn over the
    non-empty relations) plus its pieces."""
    r, rows, cols = shape
    extent = cols if order == TRANSFORM_FIRST else rows
    per = [distinct_estimate(extent, n) for n in relation_nnz]
    if order == TRANSFORM_FIRST:
        return _tiled([round(p) for p in per], (row_max,))
    if piece and row_max > piece:   # only pairs longer than a piece are split
        per = [p + (n - p) / piece for p, n in zip(per, relation_nnz)]
    touched = distinct_estimate(sum(1 for n in relation_nnz if n), row_max)
    return _tiled([round(p) for p in per],
                  (min(piece, row_max) if piece else row_max,
                   round(touched) + (row_max // piece if piece else 0)))


def order_cost(order: str, layout: Layout, nnz: int, rows: int, f_in: int, f_out: int,
               dtype: str) -> float:
    """Estimated seconds of one order on ``layout``: each kernel lasts the longest of its bytes
    at BYTES_PER_S, its FLOPs at FLOPS_PER_S and (SpMMs) its longest row at ROW_ENTRY_S, plus
    LAUNCH_S per launch (four in either order)."""
    e = 2 if dtype == "float16" else 4

    def kernel(moved: float, longest: int = 0, flops: float = 0.0) -> float:
        return max(moved / BYTES_PER_S, longest * ROW_ENTRY_S[dtype], flops / FLOPS_PER_S[dtype])

    c, p, w = layout.compact, layout.padded, layout.tiles * f_in * f_out * e
    transform_s = kernel(2 * w) + kernel(p * (f_in + f_out) * e + w, flops=2 * p * f_in * f_out)
    csr = nnz * (INDEX_BYTES + e)
    if order == TRANSFORM_FIRST:    # gather X rows, transform, SpMM over B
        steps = (kernel(p * (TAKE_BYTES + 2 * f_in * e)), transform_s,
                 kernel((rows + 1) * INDEX_BYTES + csr + (nnz + rows) * f_out * e,
                        layout.longest[0]))
    else:                           # SpMM over C, transform, SpMM over S
        steps = (kernel((p + 1) * INDEX_BYTES + csr + (nnz + p) * f_in * e, layout.longest[0]),
                 transform_s,
                 kernel((rows + 1) * INDEX_BYTES + c * (INDEX_BYTES + e) + (c + rows) * f_out * e,
                        layout.longest[1]))
    return sum(steps) + 4 * LAUNCH_S


@dataclass(frozen=True)
class RGCNPlan:
    """The order chosen for one graph shape and feature sizes, with every order's layout and
    estimated cost (seconds); ``piece``: aggregate-first's entries per piece (0: unsplit)."""

    order: str
    shape: tuple[int, int, int]   #: (relations, rows, cols)
    nnz: int
    f_in: int
    f_out: int
    dtype: str
    piece: int
    layouts: dict[str, Layout] = field(default_factory=dict)
    costs: dict[str, float] = field(default_factory=dict)

    @property
    def compact(self) -> dict[str, int]:
        """Compact rows of each order."""
        return {o: lay.compact for o, lay in self.layouts.items()}

    def table(self) -> str:
        """One line per order: compact rows, tiles, longest rows and estimated microseconds, the
        choice marked."""
        return "\n".join(
            f"{'*' if o == self.order else ' '} {o:<16} {lay.compact:>10} compact rows "
            f"({lay.tiles} tiles of {lay.tile}), longest rows {list(lay.longest)} "
            f"{self.costs[o] * 1e6:10.1f} us" for o, lay in self.layouts.items())


def _count(name: str, v: Any, least: int) -> int:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < least:
        raise ShapeError(f"{name} must be an integer >= {least}, got {v!r}")
    return int(v)


def plan_rgcn(shape: Sequence[int], relation_nnz: Sequence[int], f_in: int, f_out: int,
              dtype: str = "float16", order: str = "auto", *, row_max: int | None = None,
              piece: int | None = None, layouts: dict[str, Layout] | None = None) -> RGCNPlan:
    """Choose the order for relations of ``shape`` = (relations, rows, cols) holding
    ``relation_nnz`` edges each: ``order="auto"`` takes the cheaper by :func:`order_cost`
    (transform-first on a tie), a named order is costed and kept. ``row_max``: edges of the
    longest row, all relations together (default: rows evenly filled); ``piece``: entries per
    aggregate-first piece (default :func:`piece_entries`; 0 keeps pairs whole); ``layouts``:
    exact layouts of orders already composed (the others are estimated). The rules both orders
    rely on are derived first."""
    RGCN.derive()
    RGCN.check_dtype(dtype)
    if order not in ("auto", *ORDERS):
        raise PlanError(f"unknown RGCN order {order!r}; choose auto or {' or '.join(ORDERS)}")
    if len(shape) != 3 or min(int(s) for s in shape) < 0:
        raise ShapeError(f"RGCN shape must be (relations, rows, cols), got {tuple(shape)}")
    r, rows, cols = (int(s) for s in shape)
    nnz_r = [int(n) for n in relation_nnz]
    if len(nnz_r) != r or min(nnz_r, default=0) < 0:
        raise ShapeError(f"relation_nnz needs {r} non-negative counts, got {len(nnz_r)}")
    f_in, f_out = _count("f_in", f_in, 1), _count("f_out", f_out, 1)
    nnz = sum(nnz_r)
    if row_max is None:
        row_max = -(-nnz // rows) if rows else 0
    row_max = _count("row_max", row_max, 0)
    piece = piece_entries(row_max) if piece is None else _count("piece", piece, 0)
    known = layouts or {}
    lay = {o: known.get(o) or estimate_layout(o, (r, rows, cols), nnz_r, row_max, piece)
           for o in ORDERS}
    costs = {o: order_cost(o, lay[o], nnz, rows, f_in, f_out, dtype) for o in ORDERS}
    chosen = min(ORDERS, key=lambda o: costs[o]) if order == "auto" else order
    return RGCNPlan(chosen, (r, rows, cols), nnz, f_in, f_out, dtype, piece, lay, costs)


# -- composing the relations (one algorithm, NumPy or torch) ---------------------------------

class _NumPyOps:
    """The array operations :func:`_compose` needs, on the host."""

    @staticmethod
    def long(a: Any) -> Any:
        return np.asarray(a).astype(np.int64)

    @staticmethod
    def unique_inverse(key: Any) -> tuple[Any, Any]:
        uniq, inv = np.unique(key, return_inverse=True)
        return uniq, inv.reshape(-1)

    @staticmethod
    def counts(idx: Any, n: int, weights: Any = None) -> Any:
        return np.bincount(idx, weights, minlength=n)[:n].astype(np.int64)

    @staticmethod
    def stable_order(key: Any) -> Any:
        return np.argsort(key, kind="stable")

    @staticmethod
    def cumsum0(counts: Any) -> Any:
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @staticmethod
    def ones_like(n: int, values: Any) -> Any:
        return np.ones(n, values.dtype)

    @staticmethod
    def arange(n: int) -> Any:
        return np.arange(n, dtype=np.int64)

    @staticmethod
    def repeat(counts: Any, total: int) -> Any:
        return np.repeat(np.arange(len(counts), dtype=np.int64), counts)

    @staticmethod
    def peak(a: Any) -> Any:
        return np.array([a.max() if a.size else 0], np.int64)

    @staticmethod
    def host(*arrays: Any) -> list[int]:
        return [int(v) for a in arrays for v in np.asarray(a).reshape(-1)]

    @staticmethod
    def upload(values: list[int]) -> Any:
        return np.asarray(values, np.int64)

    @staticmethod
    def put(n: int, idx: Any, values: Any) -> Any:
        out = np.zeros(n, np.int64)
        out[idx] = values
        return out


class _TorchOps:
    """The same on ``device``; counts by index_add (torch.bincount synchronises), ``host`` is the
    one copy back."""

    def __init__(self, device: Any) -> None:
        self.device = device

    @staticmethod
    def long(a: Any) -> Any:
        return a.long()

    @staticmethod
    def unique_inverse(key: Any) -> tuple[Any, Any]:
        import torch
        return torch.unique(key, sorted=True, return_inverse=True)

    def counts(self, idx: Any, n: int, weights: Any = None) -> Any:
        import torch
        out = torch.zeros(n, dtype=torch.int64, device=self.device)
        return out.index_add_(0, idx, torch.ones_like(idx) if weights is None else weights)

    @staticmethod
    def stable_order(key: Any) -> Any:
        import torch
        return torch.sort(key, stable=True).indices

    @staticmethod
    def cumsum0(counts: Any) -> Any:
        import torch
        return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])

    @staticmethod
    def ones_like(n: int, values: Any) -> Any:
        import torch
        return torch.ones(n, dtype=values.dtype, device=values.device)

    def arange(self, n: int) -> Any:
        import torch
        return torch.arange(n, dtype=torch.int64, device=self.device)

    def repeat(self, counts: Any, total: int) -> Any:
        import torch
        return torch.repeat_interleave(self.arange(int(counts.shape[0])), counts,
                                       output_size=total)

    @staticmethod
    def peak(a: Any) -> Any:
        return a.new_zeros(1) if a.numel() == 0 else a.max().reshape(1)

    @staticmethod
    def host(*arrays: Any) -> list[int]:
        import torch
        return torch.cat([a.reshape(-1).long() for a in arrays]).tolist()

    def upload(self, values: list[int]) -> Any:
        import torch
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def put(self, n: int, idx: Any, values: Any) -> Any:
        import torch
        return torch.zeros(n, dtype=torch.int64, device=self.device).index_copy_(0, idx, values)


@dataclass
class Composed:
    """One order's operands (NumPy or torch arrays). Compact rows run relation-major, each
    relation's padded to whole tiles: ``counts`` [relations] (host) compact rows per relation,
    ``tiles`` [layout.tiles] the relation of each tile, ``take`` [layout.padded] the column of X
    each compact row gathers (transform-first) or the row of Y it goes back to
    (aggregate-first), 0 on padding rows; ``first`` the SpMM before the transform
    (aggregate-first: C) or after it (transform-first: B); ``second`` S (aggregate-first only).
    Each matrix is (indptr, indices, values, shape) with int64 indices; no entry refers to a
    padding row."""

    order: str
    shape: tuple[int, int, int]
    layout: Layout
    counts: list[int]
    tiles: Any
    take: Any
    first: Any
    second: Any = None

    @property
    def compact(self) -> int:
        return self.layout.compact


def _rows(ops: Any, order: str, shape: tuple[int, int, int], rel: Any, row: Any, col: Any,
          piece: int) -> tuple[list[int], tuple[int, ...], dict[str, Any]]:
    """What the layout of ``order`` depends on, from typed COO: the compact rows per relation
    and the longest rows (one host read), and the arrays _compose goes on with."""
    r, rows, cols = shape
    rows1, cols1 = max(rows, 1), max(cols, 1)   # no edges without both: keys stay well defined
    nnz = int(row.shape[0])
    if order == TRANSFORM_FIRST:
        uniq, q = ops.unique_inverse(rel * cols1 + col)      # compact row of each edge's source
        owner = uniq // cols1
        row_len = ops.counts(row, rows)
        host = ops.host(ops.counts(owner, r), ops.peak(row_len))
        return host[:r], (host[r],), {"uniq": uniq, "q": q, "owner": owner, "row_len": row_len}
    if order == AGGREGATE_FIRST:
        uniq, p = ops.unique_inverse(rel * rows1 + row)      # (relation, row) pair of each edge
        span = piece or max(nnz, 1)
        size = ops.counts(p, int(uniq.shape[0]))             # edges per pair
        parts = (size + span - 1) // span                    # its pieces
        pair_rel, pair_row = uniq // rows1, uniq % rows1
        host = ops.host(ops.counts(pair_rel, r, parts), ops.peak(size),
                        ops.peak(ops.counts(pair_row, rows, parts)))
        return host[:r], (min(host[r], span), host[r + 1]), {
            "p": p, "span": span, "size": size, "parts": parts, "pair_rel": pair_rel,
            "pair_row": pair_row}
    raise PlanError(f"unknown RGCN order {order!r}; choose {' or '.join(ORDERS)}")


def _compose(ops: Any, order: str, shape: tuple[int, int, int], rel: Any, row: Any, col: Any,
             values: Any, piece: int) -> Composed:
    """The operands of ``order`` from typed COO (any edge order; duplicates add), aggregate-first
    pieces of at most ``piece`` entries (0: pairs whole). Two host reads: the number of pairs,
    then the compact rows per relation with the longest rows."""
    r, rows, cols = shape
    cols1 = max(cols, 1)
    rel, row, col = ops.long(rel), ops.long(row), ops.long(col)
    nnz = int(row.shape[0])
    counts, longest, a = _rows(ops, order, shape, rel, row, col, piece)
    if order == TRANSFORM_FIRST:
        q, owner, target, row_len = a["q"], a["owner"], a["uniq"] % cols1, a["row_len"]
        n = int(a["uniq"].shape[0])
    else:
        n = sum(counts)
        p, span, size, parts = a["p"], a["span"], a["size"], a["parts"]
        o = ops.stable_order(p * cols1 + col)                # edges by pair, then column
        pair = p[o]
        k = ops.cumsum0(parts)[pair] + (ops.arange(nnz) - ops.cumsum0(size)[pair]) // span
        of = ops.repeat(parts, n)                            # the pair of each piece
        owner, target = a["pair_rel"][of], a["pair_row"][of]
    lay = _tiled(counts, longest)
    per = [-(-c // lay.tile) for c in counts]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]) if r else np.zeros(0, np.int64)
    shift = (lay.tile * np.concatenate([[0], np.cumsum(per)[:-1]]) - starts) if r else starts
    pos = ops.arange(n) + ops.upload([int(v) for v in shift])[owner]   # padded row of each
    tiles = ops.upload([rr for rr, t in enumerate(per) for _ in range(t)])
    take = ops.put(lay.padded, pos, target)
    if order == TRANSFORM_FIRST:
        o = ops.stable_order(row * max(n, 1) + q)
        first = (ops.cumsum0(row_len), pos[q[o]], values[o], (rows, lay.padded))
        second = None
    else:
        first = (ops.cumsum0(ops.counts(pos[k], lay.padded)), col[o], values[o],
                 (lay.padded, cols))
        back = ops.stable_order(target)                      # pieces by row, relation-major
        second = (ops.cumsum0(ops.counts(target, rows)), pos[back], ops.ones_like(n, values),
                  (rows, lay.padded))
    return Composed(order, shape, lay, counts, tiles, take, first, second)


def _row_max(graph: Relational) -> int:
    return int(np.bincount(graph.row).max()) if graph.nnz else 0


def layout(graph: Relational, order: str, piece: int | None = None) -> Layout:
    """The layout ``compose(graph, order, piece).layout`` has, without composing (what
    :func:`plan_rgcn` takes as an order's exact layout)."""
    piece = piece_entries(_row_max(graph)) if piece is None else piece
    ops = _NumPyOps
    counts, longest, _ = _rows(ops, order, graph.shape, ops.long(graph.rel), ops.long(graph.row),
                               ops.long(graph.col), piece)
    return _tiled(counts, longest)


def compose(graph: Relational, order: str, piece: int | None = None) -> Composed:
    """The operands of ``order`` for a host graph, each matrix a :class:`CSR` (float64);
    ``piece`` as :func:`plan_rgcn` takes it (default from the graph's longest row)."""
    piece = piece_entries(_row_max(graph)) if piece is None else piece
    c = _compose(_NumPyOps, order, graph.shape, graph.rel, graph.row, graph.col, graph.values(),
                 piece)

    def csr(m: tuple) -> CSR:
        indptr, indices, vals, shape = m
        dt = index_dtype(*shape, indices.shape[0])
        return CSR(shape, indptr.astype(dt), indices.astype(dt), vals)

    c.first = csr(c.first)
    c.second = None if c.second is None else csr(c.second)
    return c


def _weights(w: Any, shape: tuple[int, int, int]) -> np.ndarray:
    w = np.asarray(w, np.float64)
    if w.ndim != 3 or w.shape[0] != shape[0]:
        raise ShapeError(f"W must be [relations = {shape[0]}, F_in, F_out], got {w.shape}")
    return w


def _transform_numpy(h: np.ndarray, w: np.ndarray, c: Composed) -> np.ndarray:
    """Z = H @ W[relation] tile by tile, as :func:`transform` runs it."""
    t, tile = c.layout.tiles, c.layout.tile
    return np.matmul(h.reshape(t, tile, h.shape[1]), w[c.tiles]).reshape(t * tile, w.shape[2])


def execute_rgcn(plan: RGCNPlan, graph: Relational, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The plan's steps in float64 on the CPU, as the GPU runs them: compose, then gather +
    batched transform + SpMM (transform-first) or SpMM + batched transform + SpMM
    (aggregate-first)."""
    x = check_dense_operand("X", x, graph.shape[2])
    w = _weights(w, graph.shape)
    if (plan.shape, plan.f_in, plan.f_out) != (graph.shape, x.shape[1], w.shape[2]) or \
            w.shape[1] != x.shape[1]:
        raise ShapeError(f"plan for {plan.shape}, F {plan.f_in} -> {plan.f_out}; got graph "
                         f"{graph.shape}, X {x.shape}, W {w.shape}")
    c = compose(graph, plan.order, plan.piece)
    if plan.order == TRANSFORM_FIRST:
        return spmm_csr(c.first, _transform_numpy(x[c.take], w, c))
    return spmm_csr(c.second, _transform_numpy(spmm_csr(c.first, x), w, c))


# -- GPU --------------------------------------------------------------------------------------

class DeviceRelational:
    """A relation-typed adjacency on the GPU as typed COO: int32 ``rel``, ``row``, ``col`` and
    ``values`` (float32 or float16), in any order (duplicates add). Each order's composed
    operands, and plans, are built on first use and kept (the graph is treated as immutable).
    ``relation_nnz`` and ``row_max`` (edges of the longest row): host numbers when the caller
    has them, else counted on the GPU on first use (one sync each)."""

    def __init__(self, shape: Sequence[int], rel: Any, row: Any, col: Any, values: Any,
                 relation_nnz: Sequence[int] | None = None, row_max: int | None = None):
        if len(shape) != 3 or min(int(s) for s in shape) < 0:
            raise ShapeError(f"DeviceRelational shape must be (relations, rows, cols), got "
                             f"{tuple(shape)}")
        self.shape = tuple(int(s) for s in shape)
        if max(self.shape) > INT32_MAX:
            raise ShapeError(f"DeviceRelational shape {self.shape} exceeds int32 indexing")
        self.rel = check_tensor("rel", rel, ("int32",), 1)
        n = (int(rel.shape[0]),)
        self.row = check_tensor("row", row, ("int32",), 1, n)
        self.col = check_tensor("col", col, ("int32",), 1, n)
        self.values = check_tensor("values", values, VALUE_DTYPES, 1, n)
        self._relation_nnz = None if relation_nnz is None else [int(v) for v in relation_nnz]
        self._row_max = None if row_max is None else int(row_max)
        self._composed: dict[str, Composed] = {}
        self._plans: dict[tuple, RGCNPlan] = {}

    @property
    def nnz(self) -> int:
        return int(self.rel.shape[0])

    @property
    def dtype(self) -> str:
        return str(self.values.dtype).replace("torch.", "")

    @property
    def device(self) -> Any:
        """The torch device its tensors are on (operators on it run there)."""
        return self.rel.device

    @classmethod
    def from_host(cls, graph: Relational, dtype: str = "float32") -> DeviceRelational:
        """Upload a (validated) host graph; values rounded once to ``dtype``."""
        import torch
        if not isinstance(graph, Relational):
            raise ShapeError(f"from_host needs a pitgen.graph.formats.Relational, got "
                             f"{type(graph).__name__}")
        if dtype not in VALUE_DTYPES:
            raise ShapeError(f"value dtype {dtype!r} is not supported; use one of {VALUE_DTYPES}")
        if graph.nnz > INT32_MAX:
            raise ShapeError(f"{graph.nnz} edges exceed int32 indexing")

        def up(a: np.ndarray, dt: Any) -> Any:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device="cuda", dtype=dt)
        return cls(graph.shape, up(graph.rel.astype(np.int32), torch.int32),
                   up(graph.row.astype(np.int32), torch.int32),
                   up(graph.col.astype(np.int32), torch.int32),
                   up(graph.values().astype(dtype), getattr(torch, dtype)),
                   graph.relation_nnz().tolist(), _row_max(graph))

    @classmethod
    def from_relations(cls, relations: Sequence[DeviceCSR]) -> DeviceRelational:
        """One DeviceCSR per relation (one shape, one dtype), concatenated on the GPU (no sync)."""
        import torch
        if not relations or not all(isinstance(a, DeviceCSR) for a in relations):
            raise ShapeError("from_relations needs a non-empty sequence of DeviceCSR")
        if len({a.shape for a in relations}) != 1 or len({a.dtype for a in relations}) != 1:
            raise ShapeError("relations must share one shape and one dtype, got "
                             f"{sorted({(a.shape, a.dtype) for a in relations})}")
        sizes = [a.nnz for a in relations]
        dev = relations[0].indices.device
        rel = torch.repeat_interleave(
            torch.arange(len(relations), dtype=torch.int32, device=dev),
            torch.tensor(sizes, device=dev), output_size=sum(sizes))
        return cls((len(relations), *relations[0].shape), rel,
                   torch.cat([a.row_ids() for a in relations]),
                   torch.cat([a.indices for a in relations]),
                   torch.cat([a.values for a in relations]), sizes)

    def relation_nnz(self) -> list[int]:
        """Edges per relation (host numbers; one sync when the constructor was not told)."""
        if self._relation_nnz is None:
            ops = _TorchOps(self.rel.device)
            self._relation_nnz = ops.counts(self.rel.long(), self.shape[0]).tolist()
        return self._relation_nnz

    def row_max(self) -> int:
        """Edges of the longest row, all relations together (host number; one sync when the
        constructor was not told)."""
        if self._row_max is None:
            ops = _TorchOps(self.row.device)
            self._row_max = ops.host(ops.peak(ops.counts(self.row.long(), self.shape[1])))[0]
        return self._row_max

    def plan(self, f_in: int, f_out: int, order: str = "auto") -> RGCNPlan:
        """:func:`plan_rgcn` for this graph (exact layouts for orders already composed), kept
        until another order is composed."""
        key = (f_in, f_out, order, tuple(self._composed))
        hit = self._plans.get(key)
        if hit is None:
            hit = self._plans[key] = plan_rgcn(
                self.shape, self.relation_nnz(), f_in, f_out, self.dtype, order,
                row_max=self.row_max(), layouts={o: c.layout for o, c in self._composed.items()})
        return hit

    def composed(self, order: str) -> Composed:
        """``order``'s operands on the GPU: int64 ``take`` and ``tiles``, each matrix a
        DeviceCSR. Two host syncs on first use."""
        hit = self._composed.get(order)
        if hit is None:
            import torch
            c = _compose(_TorchOps(self.rel.device), order, self.shape, self.rel, self.row,
                         self.col, self.values, piece_entries(self.row_max()))
            if max(c.layout.padded, self.nnz) > INT32_MAX:
                raise ShapeError(f"{c.layout.padded} compact rows exceed int32 indexing")

            def csr(m: tuple) -> DeviceCSR:
                indptr, indices, vals, shape = m
                return DeviceCSR(shape, indptr.to(torch.int32), indices.to(torch.int32),
                                 vals.contiguous())
            c.first = csr(c.first)
            c.second = None if c.second is None else csr(c.second)
            hit = self._composed[order] = c
        return hit


@on_operand_device
def transform(h: Tensor, weight: Tensor, c: Composed) -> Tensor:
    """Z[k] = H[k] @ W[relation of k] over the padded compact rows: one ``torch.bmm`` of the
    tiles by their relations' weights (gathered per call: W may change between calls)."""
    import torch
    t, tile = c.layout.tiles, c.layout.tile
    if t == 0:   # no edges
        return h.new_empty((0, weight.shape[2]))
    z = torch.bmm(h.view(t, tile, h.shape[1]), weight.index_select(0, c.tiles))
    return z.view(t * tile, weight.shape[2])


@on_operand_device
def rgcn(graph: DeviceRelational, x: Tensor, weight: Tensor, order: str = "auto",
         out: Tensor | None = None) -> Tensor:
    """Y = sum_r A_r X W_r on the GPU: ``x`` [cols, F_in] and ``weight`` [relations, F_in,
    F_out] of the graph's dtype, fp32 accumulation in the SpMMs. ``order``: "auto" (the cost
    model, :meth:`DeviceRelational.plan`) or one of ORDERS. ``out`` [rows, F_out] is
    overwritten. The first call per graph and order composes (host syncs); later calls do not
    synchronise."""
    if not isinstance(graph, DeviceRelational):
        raise ShapeError(f"rgcn needs a DeviceRelational (DeviceRelational.from_host(g)), got "
                         f"{type(graph).__name__}")
    r, rows, cols = graph.shape
    check_tensor("x", x, (graph.dtype,), 2, (cols, None))
    check_tensor("weight", weight, (graph.dtype,), 3, (r, x.shape[1], None))
    plan = graph.plan(int(x.shape[1]), int(weight.shape[2]), order)
    c = graph.composed(plan.order)
    if plan.order == TRANSFORM_FIRST:
        return spmm(c.first, transform(x.index_select(0, c.take), weight, c), out=out, spec=RGCN)
    h = spmm(c.first, x, spec=RGCN)
    return spmm(c.second, transform(h, weight, c), out=out, spec=RGCN)


# -- torch module (built lazily: importing pitgen.ops.rgcn needs no torch) ----------------------



def _build_module_class() -> Any:
    import torch
    from torch import nn

    class RGCNConv(nn.Module):
        """Relational graph convolution (Schlichtkrull et al.), inference:
        ``Y = sum_r A_r X W_r + X W_root + b``, the relational sum by :func:`rgcn`.

        state_dict: ``weight [R, F_in, F_out]``, ``root [F_in, F_out]`` (``self_loop=True``),
        ``bias [F_out]`` (``bias=True``). ``forward(graph, x)`` takes a DeviceRelational and
        x [nodes, F_in]. No backward: call it under ``torch.no_grad()`` or
        ``torch.inference_mode()``."""

        def __init__(self, in_feat: int, out_feat: int, num_rels: int, self_loop: bool = True,
                     bias: bool = True, order: str = "auto", device: Any = None,
                     dtype: Any = None) -> None:
            super().__init__()
            if order not in ("auto", *ORDERS):
                raise PlanError(f"unknown RGCN order {order!r}; choose auto or "
                                f"{' or '.join(ORDERS)}")
            kw = {"device": device, "dtype": dtype}
            self.in_feat, self.out_feat, self.num_rels, self.order = in_feat, out_feat, num_rels, order
            scale = (6.0 / (in_feat + out_feat)) ** 0.5   # Xavier uniform
            self.weight = nn.Parameter(torch.empty(num_rels, in_feat, out_feat, **kw)
                                       .uniform_(-scale, scale))
            self.root = nn.Parameter(torch.empty(in_feat, out_feat, **kw).uniform_(-scale, scale)) \
                if self_loop else None
            self.bias = nn.Parameter(torch.zeros(out_feat, **kw)) if bias else None

        def forward(self, graph: DeviceRelational, x: Any) -> Any:
            if torch.is_grad_enabled() and (x.requires_grad or any(
                    p.requires_grad for p in self.parameters())):
                raise PlanError("RGCNConv runs inference only (no backward yet): call it under "
                                "torch.no_grad() or torch.inference_mode()")
            if graph.shape[0] != self.num_rels:
                raise ShapeError(f"the graph has {graph.shape[0]} relations, the layer "
                                 f"{self.num_rels}")
            y = rgcn(graph, x, self.weight, self.order)
            if self.root is not None:
                if graph.shape[1] != graph.shape[2]:
                    raise ShapeError(f"a self-loop needs a square graph, got {graph.shape[1:]}")
                y.addmm_(x, self.root)
            if self.bias is not None:
                y += self.bias
            return y

        def extra_repr(self) -> str:
            return (f"in_feat={self.in_feat}, out_feat={self.out_feat}, "
                    f"num_rels={self.num_rels}, order={self.order}")

    return RGCNConv


__getattr__ = lazy_torch_classes(__name__, ("RGCNConv",), lambda: {"RGCNConv": _build_module_class()})
