"""RGCN inference: ``Y[i,f] += A[r,i,j] * X[j,g] * W[r,g,f]`` over a relation-typed adjacency.

The rule engine says i is spatial and r, j, g are reduction axes, all permutation invariant.
That allows two orders, each composing all relations into one SpMM launch (SparseTIR's
horizontal fusion) with the dense transforms as one grouped matmul:

* **transform-first**: r and j are gathered together. Each (relation, source column) pair that
  holds an edge becomes one compact row: XW = X[sources] @ W_r (grouped by relation), then
  Y = B · XW, where B [rows x pairs] merges every relation's edges row by row (one CSR).
* **aggregate-first**: the (relation, row) pairs that hold an edge are the work list, rows in
  any order (i is invariant; SRead): H = C · X with C [pairs x cols] the pairs' rows stacked
  relation-major, Z = H @ W_r (grouped), then the pairs go back to their rows and relations are
  summed in any order (SWrite; r is invariant): Y = S · Z with S [rows x pairs] of ones.

:func:`plan_rgcn` picks the order with a cost model (bytes at the copy rate plus matmul FLOPs
at the dense rate) from the number of edges per relation and the feature sizes; compact sizes
not given are estimated as distinct draws. :func:`compose` builds an order's operands from
typed COO, with NumPy on the host or torch on the GPU (one algorithm: ``_NumPyOps`` and
``_TorchOps``); on the GPU it synchronises once (``torch.unique`` sizes the pairs) per graph
and order. :func:`execute_rgcn` runs a plan's steps in float64 on the CPU;
:func:`rgcn` runs them on the GPU (SpMM under RGCN's rules, ``torch._grouped_mm`` where torch
runs it for the dtype, else one matmul per relation); :class:`RGCNConv` is the layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .. import cache
from ..errors import PlanError, ShapeError
from ..graph.device import VALUE_DTYPES, DeviceCSR
from ..graph.formats import CSR, RGCN_EXPR, Relational, check_dense_operand, index_dtype
from ..graph.kernels import SPMM, spmm
from ..limits import INT32_MAX
from ..operands import check_tensor
from ..opspec import OpSpec, Permutation
from ..reference import spmm_csr
from . import lazy_torch_classes

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["EXPR", "ORDERS", "RGCN", "RGCNPlan", "plan_rgcn", "Composed", "compose",
           "execute_rgcn", "DeviceRelational", "rgcn"]

EXPR = RGCN_EXPR
TRANSFORM_FIRST, AGGREGATE_FIRST = ORDERS = ("transform-first", "aggregate-first")
#: Both orders run the CSR SpMM body over composed relations: rows (i) in any order, each
#: written to its own place, and a row's (relation, neighbour) terms gathered in any order.
RGCN = OpSpec("rgcn", "spmm.cu.j2", dict(SPMM.kernels),
              (Permutation("relation rows", EXPR, "spatial", "A"),
               Permutation("relations and neighbours", EXPR, "reduction", "A")),
              VALUE_DTYPES)

#: The cost model's device: bytes at an H100-class copy rate, dense matmul FLOPs at torch's
#: rate per dtype (fp32 without TF32), a fixed cost per launch. Only ratios decide the order.
BYTES_PER_S = 2.5e12
FLOPS_PER_S = {"float16": 4.0e14, "float32": 5.0e13}
LAUNCH_S = 4e-6
INDEX_BYTES = 4


def distinct_estimate(extent: int, draws: int) -> float:
    """Expected number of distinct values among ``draws`` uniform draws from ``extent``."""
    if extent <= 0 or draws <= 0:
        return 0.0
    return min(float(draws), extent * -math.expm1(-draws / extent))


def order_cost(order: str, nnz: int, compact: int, rows: int, relations: int, f_in: int,
               f_out: int, dtype: str) -> float:
    """Estimated seconds of one order: ``compact`` is its number of compact rows (source
    pairs for transform-first, (relation, row) pairs for aggregate-first)."""
    e = 2 if dtype == "float16" else 4
    weights = relations * f_in * f_out * e
    gemm = compact * (f_in + f_out) * e + weights
    csr = nnz * (INDEX_BYTES + e) + (rows + 1) * INDEX_BYTES
    if order == TRANSFORM_FIRST:    # gather X rows, grouped matmul, SpMM over B
        moved = 2 * compact * f_in * e + gemm + csr + nnz * f_out * e + rows * f_out * e
    else:                           # SpMM over C, grouped matmul, SpMM over S
        moved = (csr + (compact + 1) * INDEX_BYTES + nnz * f_in * e + compact * f_in * e + gemm
                 + compact * (INDEX_BYTES + e) + (rows + 1) * INDEX_BYTES + compact * f_out * e
                 + rows * f_out * e)
    return moved / BYTES_PER_S + 2 * compact * f_in * f_out / FLOPS_PER_S[dtype] + 3 * LAUNCH_S


@dataclass(frozen=True)
class RGCNPlan:
    """The order chosen for one graph shape and feature sizes, with every order's compact
    rows and estimated cost (seconds)."""

    order: str
    shape: tuple[int, int, int]   #: (relations, rows, cols)
    nnz: int
    f_in: int
    f_out: int
    dtype: str
    compact: dict[str, int] = field(default_factory=dict)
    costs: dict[str, float] = field(default_factory=dict)

    def table(self) -> str:
        """One line per order: compact rows and estimated microseconds, the choice marked."""
        return "\n".join(f"{'*' if o == self.order else ' '} {o:<16} {self.compact[o]:>10} "
                         f"compact rows  {self.costs[o] * 1e6:10.1f} us" for o in ORDERS)


def _positive(name: str, v: Any) -> int:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ShapeError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def plan_rgcn(shape: Sequence[int], relation_nnz: Sequence[int], f_in: int, f_out: int,
              dtype: str = "float16", order: str = "auto", sources: int | None = None,
              pairs: int | None = None) -> RGCNPlan:
    """Choose the order for relations of ``shape`` = (relations, rows, cols) holding
    ``relation_nnz`` edges each: ``order="auto"`` takes the cheaper by :func:`order_cost`
    (transform-first on a tie), a named order is costed and kept. ``sources`` (distinct
    (relation, column) pairs) and ``pairs`` (distinct (relation, row) pairs) are estimated from
    the edge counts when not given. The rules both orders rely on are derived first."""
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
    f_in, f_out = _positive("f_in", f_in), _positive("f_out", f_out)
    compact = {
        TRANSFORM_FIRST: sources if sources is not None else
        round(sum(distinct_estimate(cols, n) for n in nnz_r)),
        AGGREGATE_FIRST: pairs if pairs is not None else
        round(sum(distinct_estimate(rows, n) for n in nnz_r))}
    nnz = sum(nnz_r)
    costs = {o: order_cost(o, nnz, compact[o], rows, r, f_in, f_out, dtype) for o in ORDERS}
    chosen = min(ORDERS, key=lambda o: costs[o]) if order == "auto" else order
    return RGCNPlan(chosen, (r, rows, cols), nnz, f_in, f_out, dtype, compact, costs)


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
    def counts(idx: Any, n: int) -> Any:
        return np.bincount(idx, minlength=n)[:n].astype(np.int64)

    @staticmethod
    def stable_order(key: Any) -> Any:
        return np.argsort(key, kind="stable")

    @staticmethod
    def cumsum0(counts: Any) -> Any:
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @staticmethod
    def ones_like(n: int, values: Any) -> Any:
        return np.ones(n, values.dtype)


class _TorchOps:
    """The same on the GPU; counts by index_add (torch.bincount synchronises)."""

    @staticmethod
    def long(a: Any) -> Any:
        return a.long()

    @staticmethod
    def unique_inverse(key: Any) -> tuple[Any, Any]:
        import torch
        return torch.unique(key, sorted=True, return_inverse=True)

    @staticmethod
    def counts(idx: Any, n: int) -> Any:
        import torch
        out = torch.zeros(n, dtype=torch.int64, device=idx.device)
        return out.index_add_(0, idx, torch.ones_like(idx))

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


@dataclass
class Composed:
    """One order's operands (NumPy or torch arrays). ``take`` [compact]: the column of X each
    compact row gathers (transform-first) or the row of Y it goes back to (aggregate-first),
    compact rows relation-major; ``ends`` [relations]: cumulative compact-row ends per relation
    (``torch._grouped_mm``'s ``offs``); ``first`` the SpMM before the transform (aggregate-first:
    C) or after it (transform-first: B); ``second`` S (aggregate-first only). Each matrix is
    (indptr, indices, values, shape) with int64 indices. ``host_ends``: ``ends`` on the host,
    once something needed them."""

    order: str
    shape: tuple[int, int, int]
    compact: int
    take: Any
    ends: Any
    first: Any
    second: Any = None
    host_ends: list[int] | None = None


def _compose(ops: Any, order: str, shape: tuple[int, int, int], rel: Any, row: Any, col: Any,
             values: Any) -> Composed:
    """The operands of ``order`` from typed COO (any edge order; duplicates add)."""
    r, rows, cols = shape
    rows, cols = max(rows, 1), max(cols, 1)   # no edges without both: keys stay well defined
    rel, row, col = ops.long(rel), ops.long(row), ops.long(col)
    if order == TRANSFORM_FIRST:
        uniq, q = ops.unique_inverse(rel * cols + col)      # compact row of each edge's source
        n = int(uniq.shape[0])
        take, owner = uniq % cols, uniq // cols
        o = ops.stable_order(row * n + q)
        first = (ops.cumsum0(ops.counts(row, shape[1])), q[o], values[o], (shape[1], n))
        second = None
    elif order == AGGREGATE_FIRST:
        uniq, p = ops.unique_inverse(rel * rows + row)      # compact row of each edge's target
        n = int(uniq.shape[0])
        take, owner = uniq % rows, uniq // rows
        o = ops.stable_order(p * cols + col)
        first = (ops.cumsum0(ops.counts(p, n)), col[o], values[o], (n, shape[2]))
        back = ops.stable_order(take)                      # pairs by row, relations in order
        second = (ops.cumsum0(ops.counts(take, shape[1])), back, ops.ones_like(n, values),
                  (shape[1], n))
    else:
        raise PlanError(f"unknown RGCN order {order!r}; choose {' or '.join(ORDERS)}")
    return Composed(order, shape, n, take, ops.cumsum0(ops.counts(owner, r))[1:], first, second)


def compose(graph: Relational, order: str) -> Composed:
    """The operands of ``order`` for a host graph, each matrix a :class:`CSR` (float64)."""
    c = _compose(_NumPyOps, order, graph.shape, graph.rel, graph.row, graph.col, graph.values())

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


def _grouped_numpy(h: np.ndarray, w: np.ndarray, ends: np.ndarray) -> np.ndarray:
    z = np.zeros((h.shape[0], w.shape[2]))
    lo = 0
    for r, hi in enumerate(ends):
        z[lo:hi] = h[lo:hi] @ w[r]
        lo = hi
    return z


def execute_rgcn(plan: RGCNPlan, graph: Relational, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The plan's steps in float64 on the CPU, as the GPU runs them: compose, then gather +
    grouped matmul + SpMM (transform-first) or SpMM + grouped matmul + SpMM (aggregate-first)."""
    x = check_dense_operand("X", x, graph.shape[2])
    w = _weights(w, graph.shape)
    if (plan.shape, plan.f_in, plan.f_out) != (graph.shape, x.shape[1], w.shape[2]) or \
            w.shape[1] != x.shape[1]:
        raise ShapeError(f"plan for {plan.shape}, F {plan.f_in} -> {plan.f_out}; got graph "
                         f"{graph.shape}, X {x.shape}, W {w.shape}")
    c = compose(graph, plan.order)
    if plan.order == TRANSFORM_FIRST:
        return spmm_csr(c.first, _grouped_numpy(x[c.take], w, c.ends))
    return spmm_csr(c.second, _grouped_numpy(spmm_csr(c.first, x), w, c.ends))


# -- GPU --------------------------------------------------------------------------------------

#: (dtype, F_in, F_out) -> whether torch._grouped_mm ran it (learnt on first use)
_GROUPED = cache.memo("rgcn.grouped_mm")


class DeviceRelational:
    """A relation-typed adjacency on the GPU as typed COO: int32 ``rel``, ``row``, ``col`` and
    ``values`` (float32 or float16), in any order (duplicates add). Each order's composed
    operands are built on first use and kept (the graph is treated as immutable)."""

    def __init__(self, shape: Sequence[int], rel: Any, row: Any, col: Any, values: Any,
                 relation_nnz: Sequence[int] | None = None):
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
        self._composed: dict[str, Composed] = {}

    @property
    def nnz(self) -> int:
        return int(self.rel.shape[0])

    @property
    def dtype(self) -> str:
        return str(self.values.dtype).replace("torch.", "")

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
                   graph.relation_nnz().tolist())

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
            self._relation_nnz = _TorchOps.counts(self.rel.long(), self.shape[0]).tolist()
        return self._relation_nnz

    def plan(self, f_in: int, f_out: int, order: str = "auto") -> RGCNPlan:
        """:func:`plan_rgcn` for this graph (exact compact sizes for orders already composed)."""
        known = {o: c.compact for o, c in self._composed.items()}
        return plan_rgcn(self.shape, self.relation_nnz(), f_in, f_out, self.dtype, order,
                         sources=known.get(TRANSFORM_FIRST), pairs=known.get(AGGREGATE_FIRST))

    def composed(self, order: str) -> Composed:
        """``order``'s operands on the GPU: int64 ``take``, int32 ``ends``, each matrix a
        DeviceCSR. One host sync on first use."""
        hit = self._composed.get(order)
        if hit is None:
            import torch
            c = _compose(_TorchOps, order, self.shape, self.rel, self.row, self.col, self.values)
            if max(c.compact, self.nnz) > INT32_MAX:
                raise ShapeError(f"{c.compact} compact rows exceed int32 indexing")

            def csr(m: tuple) -> DeviceCSR:
                indptr, indices, vals, shape = m
                return DeviceCSR(shape, indptr.to(torch.int32), indices.to(torch.int32),
                                 vals.contiguous())
            c.ends = c.ends.to(torch.int32)
            c.first = csr(c.first)
            c.second = None if c.second is None else csr(c.second)
            hit = self._composed[order] = c
        return hit


def _segments(c: Composed) -> list[tuple[int, int]]:
    """(first, end) compact rows of every relation (host numbers; one sync, then kept)."""
    if c.host_ends is None:
        c.host_ends = c.ends.tolist()
    ends = c.host_ends
    return list(zip([0, *ends[:-1]], ends))


def grouped_matmul(h: Tensor, w: Tensor, c: Composed) -> Tensor:
    """Z[k] = H[k] @ W[relation of k] over the relation-major compact rows: one
    ``torch._grouped_mm`` where torch runs it for this dtype and shape, else one matmul per
    relation that has rows."""
    import torch
    z = torch.empty((h.shape[0], w.shape[2]), dtype=h.dtype, device=h.device)
    if h.shape[0] == 0:
        return z
    key = (str(h.dtype), int(h.shape[1]), int(w.shape[2]))
    if _GROUPED.get(key, True) and hasattr(torch, "_grouped_mm"):
        try:
            out = torch._grouped_mm(h, w, offs=c.ends)
            _GROUPED[key] = True
            return out
        except (RuntimeError, ValueError, TypeError, NotImplementedError):
            _GROUPED[key] = False
    for r, (lo, hi) in enumerate(_segments(c)):
        if hi > lo:
            torch.mm(h[lo:hi], w[r], out=z[lo:hi])
    return z


def rgcn(graph: DeviceRelational, x: Tensor, weight: Tensor, order: str = "auto",
         out: Tensor | None = None) -> Tensor:
    """Y = sum_r A_r X W_r on the GPU: ``x`` [cols, F_in] and ``weight`` [relations, F_in,
    F_out] of the graph's dtype, fp32 accumulation in the SpMMs. ``order``: "auto" (the cost
    model, :meth:`DeviceRelational.plan`) or one of ORDERS. ``out`` [rows, F_out] is
    overwritten. The first call per graph and order composes (one host sync); later calls do
    not synchronise, except the per-relation matmul fallback's first call."""
    if not isinstance(graph, DeviceRelational):
        raise ShapeError(f"rgcn needs a DeviceRelational (DeviceRelational.from_host(g)), got "
                         f"{type(graph).__name__}")
    r, rows, cols = graph.shape
    check_tensor("x", x, (graph.dtype,), 2, (cols, None))
    check_tensor("weight", weight, (graph.dtype,), 3, (r, x.shape[1], None))
    plan = graph.plan(int(x.shape[1]), int(weight.shape[2]), order)
    c = graph.composed(plan.order)
    if plan.order == TRANSFORM_FIRST:
        xw = grouped_matmul(x.index_select(0, c.take), weight, c)
        return spmm(c.first, xw, out=out, spec=RGCN)
    h = spmm(c.first, x, spec=RGCN)
    return spmm(c.second, grouped_matmul(h, weight, c), out=out, spec=RGCN)


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
