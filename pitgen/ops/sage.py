"""GraphSAGE training: graph SpMM with autograd, and ``SAGEConv``.

``Y = A X`` for a graph A held as a :class:`~pitgen.graph.device.DeviceCSR` (row i lists the
nodes whose features node i aggregates) runs pitgen's CSR SpMM (templates/spmm.cu.j2), with
autograd through one custom operator, ``pitgen::graph_spmm``:

* ``dX = Aᵀ dY``: the same SpMM over Aᵀ, which :meth:`DeviceCSR.transpose` builds on the GPU
  once per graph (count per column, scan, scatter: no sort, since SpMM's rules let a
  transposed row's entries be summed in any order; templates/graph_transpose.cu.j2) and keeps
  with it. Aᵀ's values are gathered from A's at every call, so learnt edge values work.
* ``dA`` (edge values, when they require grad) ``= SDDMM(dY, X)`` on A's pattern, in A's CSR
  order (``pitgen::graph_sddmm``, pitgen's graph SDDMM kernel).

The backward of ``graph_spmm`` is ``graph_spmm`` on Aᵀ, so gradients of gradients of X work.
Aggregators: ``sum`` (edge values 1) and ``mean`` (1 / in-degree of the row), computed on the
GPU from the pattern once per graph and dtype. Nothing in the dynamic path synchronises with
the host. The torch operators and ``SAGEConv`` are built on first use: importing this module
needs no torch.
"""
from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

from ..errors import PlanError, ShapeError
from ..graph.device import VALUE_DTYPES, DeviceCSR
from ..graph.kernels import SPMM, sddmm, spmm
from ..operands import check_tensor
from . import lazy_torch_classes

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["AGGREGATORS", "aggregation_values", "graph_spmm", "aggregate", "sage_reference"]

AGGREGATORS = ("mean", "sum")
#: The graph tensors every call of ``pitgen::graph_spmm`` takes after (x, values): A's CSR and
#: row ids, then Aᵀ's, then the two position maps (Aᵀ entry -> A entry, A entry -> Aᵀ entry).
_GRAPH_ARGS = ("indptr", "indices", "rows", "t_indptr", "t_indices", "t_rows", "t_perm",
               "inverse")
SPMM_SCHEMA = "(Tensor x, Tensor values, " + ", ".join(f"Tensor {n}" for n in _GRAPH_ARGS) + \
    ") -> Tensor"
SDDMM_SCHEMA = "(Tensor u, Tensor v, Tensor indptr, Tensor indices, Tensor rows) -> Tensor"
#: DeviceCSR -> {(aggregator, dtype): edge values}; dropped with the graph.
_VALUES: "weakref.WeakKeyDictionary[DeviceCSR, dict]" = weakref.WeakKeyDictionary()


def _check_graph(graph: Any) -> DeviceCSR:
    if not isinstance(graph, DeviceCSR):
        raise ShapeError(f"graph must be a pitgen DeviceCSR (DeviceCSR.from_host / from_scipy), "
                         f"got {type(graph).__name__}")
    return graph


def _check_aggr(aggr: Any) -> str:
    if aggr not in AGGREGATORS:
        raise PlanError(f"unknown aggregator {aggr!r}; choose {' or '.join(AGGREGATORS)}")
    return aggr


def aggregation_values(graph: DeviceCSR, aggr: str, dtype: str) -> Tensor:
    """Edge values [nnz] of an aggregator, in ``graph``'s CSR order and ``dtype``: ``sum``
    gives 1, ``mean`` 1 / (entries in the row). Built on the GPU (no sync) once per graph,
    aggregator and dtype."""
    import torch
    _check_graph(graph)
    _check_aggr(aggr)
    if dtype not in VALUE_DTYPES:
        raise ShapeError(f"dtype {dtype!r} is not supported; use one of {VALUE_DTYPES}")
    per = _VALUES.setdefault(graph, {})
    hit = per.get((aggr, dtype))
    if hit is None:
        tdt = getattr(torch, dtype)
        if aggr == "sum":
            hit = torch.ones(graph.nnz, dtype=tdt, device=graph.indices.device)
        else:
            deg = (graph.indptr[1:] - graph.indptr[:-1]).clamp(min=1).to(torch.float32)
            hit = deg.reciprocal().index_select(0, graph.row_ids().clamp(min=0)).to(tdt)
        per[(aggr, dtype)] = hit
    return hit


def _csr(indptr: Any, indices: Any, values: Any, rows: Any, n_cols: int) -> DeviceCSR:
    return DeviceCSR((int(indptr.shape[0]) - 1, n_cols), indptr, indices, values, rows=rows)


@functools.lru_cache(maxsize=1)
def _ops() -> Any:
    """Register ``pitgen::graph_spmm`` (with autograd) and ``pitgen::graph_sddmm`` once."""
    import torch

    @torch.library.custom_op("pitgen::graph_sddmm", mutates_args=(), schema=SDDMM_SCHEMA)
    def graph_sddmm_op(u, v, indptr, indices, rows):
        """E[p] = U[row(p)] . V[col(p)] over the pattern (indptr, indices) in CSR order."""
        a = _csr(indptr, indices, u.new_empty(indices.shape[0]), rows, int(v.shape[0]))
        return sddmm(a, u.contiguous(), v.contiguous())

    @graph_sddmm_op.register_fake
    def _(u, v, indptr, indices, rows):
        return u.new_empty(indices.shape[0])

    @torch.library.custom_op("pitgen::graph_spmm", mutates_args=(), schema=SPMM_SCHEMA)
    def graph_spmm_op(x, values, indptr, indices, rows, t_indptr, t_indices, t_rows, t_perm,
                      inverse):
        """Y = A X for A = (indptr, indices, values) with x.shape[0] columns."""
        return spmm(_csr(indptr, indices, values, rows, int(x.shape[0])), x.contiguous())

    @graph_spmm_op.register_fake
    def _(x, values, indptr, indices, rows, t_indptr, t_indices, t_rows, t_perm, inverse):
        return x.new_empty((indptr.shape[0] - 1, x.shape[1]))

    def setup_context(ctx, inputs, output):
        x, values, *graph = inputs   # x only feeds dA: kept only when the values learn
        ctx.save_for_backward(x if values.requires_grad else None, values, *graph)

    def backward(ctx, dy):
        x, values, indptr, indices, rows, t_indptr, t_indices, t_rows, t_perm, inverse = \
            ctx.saved_tensors
        dx = dv = None
        if ctx.needs_input_grad[0]:   # dX = Aᵀ dY: the same operator on the transpose
            dx = graph_spmm_op(dy, values.index_select(0, t_perm), t_indptr, t_indices, t_rows,
                               indptr, indices, rows, inverse, t_perm)
        if ctx.needs_input_grad[1]:   # dA = dY Xᵀ sampled on A's pattern
            dv = graph_sddmm_op(dy, x, indptr, indices, rows)
        return (dx, dv) + (None,) * len(_GRAPH_ARGS)

    graph_spmm_op.register_autograd(backward, setup_context=setup_context)
    return graph_spmm_op


def _graph_tensors(graph: DeviceCSR) -> tuple:
    t = graph.transpose()
    return (graph.indptr, graph.indices, graph.row_ids(), t.csr.indptr, t.csr.indices,
            t.csr.row_ids(), t.perm, t.inverse)


def graph_spmm(graph: DeviceCSR, x: Tensor, values: Tensor | None = None) -> Tensor:
    """Y = A X [rows, F] with gradients to ``x`` and to ``values`` (edge values [nnz] in A's
    CSR order, ``graph.values`` when None), float32 or float16 with fp32 accumulation. The
    first call per graph builds Aᵀ on the GPU; no call synchronises with the host."""
    _check_graph(graph)
    SPMM.derive()
    dtype = graph.dtype if values is None else str(values.dtype).replace("torch.", "")
    check_tensor("x", x, VALUE_DTYPES, 2, (graph.shape[1], None), contiguous=False)
    xdt = str(x.dtype).replace("torch.", "")
    if values is None:
        values = graph.values
    check_tensor("values", values, VALUE_DTYPES, 1, (graph.nnz,), contiguous=False)
    if xdt != dtype:
        raise ShapeError(f"x is {xdt} but the edge values are {dtype}: pass values of x's dtype "
                         f"(or x.to(torch.{dtype}))")
    if graph.shape[0] * x.shape[1] > 2**31 - 1 or graph.shape[1] * x.shape[1] > 2**31 - 1:
        raise ShapeError(f"graph_spmm operands of {max(graph.shape)} x {x.shape[1]} exceed int32 "
                         f"indexing")
    return _ops()(x, values.contiguous(), *_graph_tensors(graph))


def aggregate(graph: DeviceCSR, x: Tensor, aggr: str = "mean") -> Tensor:
    """The ``aggr`` ("mean" or "sum") of every node's neighbours' rows of ``x`` (the graph's
    own values are not used), with autograd to ``x``."""
    _check_graph(graph)
    _check_aggr(aggr)
    check_tensor("x", x, VALUE_DTYPES, 2, (graph.shape[1], None), contiguous=False)
    return graph_spmm(graph, x, aggregation_values(graph, aggr, str(x.dtype).replace("torch.", "")))


def sage_reference(indptr: Any, indices: Any, x: Any, w_neigh: Any, w_root: Any, bias: Any,
                   aggr: str = "mean") -> Any:
    """SAGEConv in float64 NumPy: ``aggr_j x_j @ w_neighᵀ + x @ w_rootᵀ + bias`` (w_root and
    bias may be None), for a square CSR pattern (indptr, indices)."""
    import numpy as np
    _check_aggr(aggr)
    indptr, indices = np.asarray(indptr, np.int64), np.asarray(indices, np.int64)
    x = np.asarray(x, np.float64)
    n = indptr.shape[0] - 1
    rows = np.repeat(np.arange(n), np.diff(indptr))
    h = np.zeros((n, x.shape[1]))
    np.add.at(h, rows, x[indices])
    if aggr == "mean":
        h /= np.maximum(np.diff(indptr), 1)[:, None]
    y = h @ np.asarray(w_neigh, np.float64).T
    if w_root is not None:
        y += x @ np.asarray(w_root, np.float64).T
    if bias is not None:
        y += np.asarray(bias, np.float64)
    return y


# -- torch module (built lazily: importing pitgen.ops.sage needs no torch) --------------------

def _build_module_classes() -> dict[str, type]:
    import torch
    from torch import nn

    class SAGEConv(nn.Module):
        """GraphSAGE convolution (Hamilton et al.) as PyG writes it:
        ``Y = lin_l(aggr_{j in N(i)} x_j) + lin_r(x_i)``, ``aggr`` "mean" or "sum".

        state_dict: ``lin_l.weight [out, in]``, ``lin_l.bias [out]`` (``bias=True``),
        ``lin_r.weight [out, in]`` (``root_weight=True``), PyG's names. ``forward(graph, x)``
        takes a DeviceCSR (row i: the nodes node i aggregates from) and x [nodes, in]; trains
        (gradients to x and every parameter). With ``in > out`` the neighbour weight is applied
        before the aggregation (fewer features to gather; the same result: it is linear)."""

        def __init__(self, in_channels: int, out_channels: int, aggr: str = "mean",
                     root_weight: bool = True, bias: bool = True, device: Any = None,
                     dtype: Any = None) -> None:
            super().__init__()
            for name, v in (("in_channels", in_channels), ("out_channels", out_channels)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ShapeError(f"{name} must be a positive integer, got {v!r}")
            self.in_channels, self.out_channels = in_channels, out_channels
            self.aggr = _check_aggr(aggr)
            kw = {"device": device, "dtype": dtype}
            self.lin_l = nn.Linear(in_channels, out_channels, bias=bias, **kw)
            self.lin_r = nn.Linear(in_channels, out_channels, bias=False, **kw) \
                if root_weight else None

        def propagate(self, graph: Any, x: Any) -> Any:
            """The neighbour aggregation (pitgen's SpMM; the benchmark's peer overrides it)."""
            return aggregate(graph, x, self.aggr)

        def forward(self, graph: Any, x: Any) -> Any:
            if x.dim() != 2 or x.shape[1] != self.in_channels:
                raise ShapeError(f"x must be [nodes, {self.in_channels}], got {tuple(x.shape)}")
            if self.in_channels > self.out_channels:
                y = self.propagate(graph, torch.nn.functional.linear(x, self.lin_l.weight))
                if self.lin_l.bias is not None:
                    y = y + self.lin_l.bias
            else:
                y = self.lin_l(self.propagate(graph, x))
            if self.lin_r is not None:
                y = y + self.lin_r(x)
            return y

        def extra_repr(self) -> str:
            return (f"{self.in_channels}, {self.out_channels}, aggr={self.aggr!r}, "
                    f"root_weight={self.lin_r is not None}")

    class GraphSAGE(nn.Module):
        """``layers`` SAGEConv layers (in -> hidden ... -> out), ReLU between them."""

        def __init__(self, in_channels: int, hidden: int, out_channels: int, layers: int = 2,
                     aggr: str = "mean", conv: type = SAGEConv, device: Any = None,
                     dtype: Any = None) -> None:
            super().__init__()
            if not isinstance(layers, int) or layers < 1:
                raise ShapeError(f"layers must be a positive integer, got {layers!r}")
            sizes = [in_channels] + [hidden] * (layers - 1) + [out_channels]
            self.convs = nn.ModuleList(conv(a, b, aggr, device=device, dtype=dtype)
                                       for a, b in zip(sizes, sizes[1:]))

        def forward(self, graph: Any, x: Any) -> Any:
            for i, conv in enumerate(self.convs):
                x = conv(graph, x)
                if i + 1 < len(self.convs):
                    x = torch.relu(x)
            return x

    return {"SAGEConv": SAGEConv, "GraphSAGE": GraphSAGE}


__getattr__ = lazy_torch_classes(__name__, ("SAGEConv", "GraphSAGE"), _build_module_classes)
