"""GraphSAGE training: graph SpMM with autograd, and ``SAGEConv``.

``Y = A X`` for a graph A held as a :class:`~pitgen.graph.device.DeviceCSR` (row i lists the
nodes whose features node i aggregates) runs pitgen's graph SpMM (templates/spmm.cu.j2), with
autograd through one custom operator, ``pitgen::graph_spmm``:

* ``dX = Aᵀ dY``: the same SpMM over Aᵀ, which :meth:`DeviceCSR.transpose` builds on the GPU
  once per graph (count per column, scan, stable sort by column, place;
  templates/graph_transpose.cu.j2; no host sync) and keeps with it. Aᵀ's values are gathered
  from A's (an aggregator's once, learnt ones every call).
* ``dA`` (edge values, when they require grad) ``= SDDMM(dY, X)`` on A's pattern, in A's CSR
  order (``pitgen::graph_sddmm``, pitgen's graph SDDMM kernel).

A and Aᵀ run in a format of pitgen.graph ("auto" by default: a tuned result of the tune cache,
else the cost model of pitgen.graph.model, or with ``tune=True`` a measured search; or one named,
e.g. hyb: CSR's one group per row is slow on power-law rows), each converted on the GPU once
per graph and feature width (:class:`GraphPlan`, one host sync per conversion); "csr" runs
straight from the CSR tensors. An explicit format is checked against the cost model once per
graph, feature width and dtype (one host sync for the row statistics; a FormatWarning when it is
modelled ten times slower than the model's choice).
The backward of ``graph_spmm`` is ``graph_spmm`` on Aᵀ, so gradients of gradients of X work.
Aggregators: ``sum`` (edge values 1) and ``mean`` (1 / in-degree of the row), computed on the
GPU from the pattern once per graph and dtype. After the first call per graph and feature
width, nothing synchronises with the host. The torch operators and ``SAGEConv`` are built on
first use: importing this module needs no torch.
"""
from __future__ import annotations

import functools
import itertools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import PlanError, ShapeError
from ..graph.device import VALUE_DTYPES, DeviceCSR, DeviceMatrix, to_format
from ..graph.formats import FORMATS
from ..graph.kernels import SPMM, default_schedule, sddmm, spmm
from ..graph.jit import search_settings
from ..graph.model import plan as auto_plan, warn_if_slow
from ..graph.tune import GraphStats, default_params
from ..operands import check_tensor, on_operand_device, raw_key, validated
from . import lazy_torch_classes

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["AGGREGATORS", "SAGE_FORMATS", "DEFAULT_FORMAT", "GraphPlan", "aggregation_values",
           "graph_plan", "graph_spmm", "aggregate", "sage_conv", "sage_reference"]

AGGREGATORS = ("mean", "sum")
#: The layouts the SpMMs of training may run: a format of pitgen.graph (converted on the GPU
#: once per graph), or "auto" (the tune cache, else the cost model; with ``tune=True`` a search
#: of AUTO_BUDGET_S per direction).
SAGE_FORMATS = (*FORMATS, "auto")
#: The cost model's choice per graph, width and dtype (tune cache first): in the sage benchmark
#: (H200, session 34) within 1% of hyb(c=1, k from the mean row), the default before, on the
#: five smaller graphs and up to 1.41x faster on the two largest (reddit, float32).
DEFAULT_FORMAT = "auto"
AUTO_BUDGET_S = 2.0
#: DeviceCSR -> {(format, feature width, dtype)} already checked against the cost model.
_CHECKED: "weakref.WeakKeyDictionary[DeviceCSR, set]" = weakref.WeakKeyDictionary()
#: The graph tensors every call of ``pitgen::graph_spmm`` takes after (x, values): A's CSR and
#: row ids, then Aᵀ's, then the two position maps (Aᵀ entry -> A entry, A entry -> Aᵀ entry),
#: then the plan (0: CSR from these tensors; +k / -k: plan k's layout of A / of Aᵀ).
_GRAPH_ARGS = ("indptr", "indices", "rows", "t_indptr", "t_indices", "t_rows", "t_perm",
               "inverse")
SPMM_SCHEMA = "(Tensor x, Tensor values, " + ", ".join(f"Tensor {n}" for n in _GRAPH_ARGS) + \
    ", int plan) -> Tensor"
SDDMM_SCHEMA = "(Tensor u, Tensor v, Tensor indptr, Tensor indices, Tensor rows) -> Tensor"
#: DeviceCSR -> {(aggregator, dtype): edge values}; dropped with the graph.
_VALUES: "weakref.WeakKeyDictionary[DeviceCSR, dict]" = weakref.WeakKeyDictionary()
#: DeviceCSR -> {(values kind, dtype): (A, Aᵀ) with those values; (values kind, dtype, format,
#: feat): GraphPlan}; dropped with the graph.
_PLANS: "weakref.WeakKeyDictionary[DeviceCSR, dict]" = weakref.WeakKeyDictionary()
#: plan id -> the plan (weak: the graph's _PLANS entry keeps it alive)
_BY_ID: "dict[int, weakref.ref]" = {}
_IDS = itertools.count(1)


def _check_graph(graph: Any) -> DeviceCSR:
    if not isinstance(graph, DeviceCSR):
        raise ShapeError(f"graph must be a pitgen DeviceCSR (DeviceCSR.from_host / from_scipy), "
                         f"got {type(graph).__name__}")
    return graph


def _check_aggr(aggr: Any) -> str:
    if aggr not in AGGREGATORS:
        raise PlanError(f"unknown aggregator {aggr!r}; choose {' or '.join(AGGREGATORS)}")
    return aggr


def _check_format(fmt: Any) -> str:
    if fmt not in SAGE_FORMATS:
        raise PlanError(f"unknown format {fmt!r}; choose one of {', '.join(SAGE_FORMATS)}")
    return fmt


def _check_tune(fmt: str, tune: Any) -> bool:
    """``tune`` is a bool, and True only with format "auto" (a search chooses a format)."""
    search_settings(tune, None)
    if tune and fmt != "auto":
        raise PlanError(f"tune=True searches formats: it needs format='auto', not {fmt!r}")
    return tune


@on_operand_device
def aggregation_values(graph: DeviceCSR, aggr: str, dtype: str) -> Tensor:
    """Edge values [nnz] of an aggregator, in ``graph``'s CSR order and ``dtype``: ``sum``
    gives 1, ``mean`` 1 / (entries in the row). Built on the GPU (no sync) once per graph,
    aggregator and dtype."""
    _check_graph(graph)
    _check_aggr(aggr)
    if dtype not in VALUE_DTYPES:
        raise ShapeError(f"dtype {dtype!r} is not supported; use one of {VALUE_DTYPES}")
    import torch
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


@dataclass(eq=False)
class GraphPlan:
    """What one graph's SpMMs run at one feature width: the layout of A (``fwd``) and of Aᵀ
    (``bwd``), each a DeviceMatrix converted on the GPU with its schedule. ``owned``: the edge
    values are pitgen's (an aggregator's, never changed), so the layouts' own values are used;
    otherwise every call refills them from the values it is given (a gather, no sync)."""
    fwd: DeviceMatrix
    fwd_schedule: dict
    bwd: DeviceMatrix
    bwd_schedule: dict
    owned: bool
    ident: int = 0


def _layout(csr: DeviceCSR, fmt: str, feat: int, tune: bool = False) -> tuple[DeviceMatrix, dict]:
    """``csr`` in ``fmt`` (conversion cached on it) with the schedule for ``feat``: defaults
    (checked against the cost model), or with "auto" the tune cache / the model (``tune``: a
    search of AUTO_BUDGET_S when the cache has none). One host sync for the row statistics;
    conversions other than CSR sync once more."""
    if fmt == "auto":
        c = auto_plan(csr, "spmm", feat, csr.dtype, tune, AUTO_BUDGET_S)
        return to_format(csr, c.fmt, **c.params), c.schedule
    stats = GraphStats.from_dict(csr.row_stats())
    params, sched = default_params(fmt, stats), default_schedule("spmm", fmt, feat, csr.dtype)
    warn_if_slow(stats, "spmm", feat, csr.dtype, fmt, params, sched, stacklevel=6)
    return to_format(csr, fmt, **params), sched


def _check_csr(graph: DeviceCSR, feat: int, dtype: str) -> None:
    """The cost model's check of format "csr" (which runs from the tensors, with no plan),
    once per graph, feature width and dtype: one host sync for the row statistics."""
    seen = _CHECKED.setdefault(graph, set())
    if (feat, dtype) in seen:
        return
    seen.add((feat, dtype))
    stats = GraphStats.from_dict(graph.row_stats())
    warn_if_slow(stats, "spmm", feat, dtype, "csr", {},
                 default_schedule("spmm", "csr", feat, dtype), stacklevel=5)


@on_operand_device
def graph_plan(graph: DeviceCSR, values: Tensor, feat: int, fmt: str = DEFAULT_FORMAT,
               owned: bool = False, tune: bool = False) -> GraphPlan:
    """The plan of ``graph`` with edge ``values`` (the aggregator's when ``owned``) at ``feat``
    features in format ``fmt``: A and Aᵀ converted on the GPU (Aᵀ from
    :meth:`DeviceCSR.transpose`), built on first use and kept with the graph. The first call
    synchronises with the host (row statistics, conversions; with "auto" and ``tune``, a
    search); later calls do not."""
    _check_graph(graph)
    _check_format(fmt)
    _check_tune(fmt, tune)
    dtype = str(values.dtype).replace("torch.", "")
    per = _PLANS.setdefault(graph, {})
    kind = ((values.data_ptr(), "owned") if owned else "values", dtype)
    key = (*kind, fmt, feat, tune)
    hit = per.get(key)
    if hit is None:
        if kind not in per:   # A and Aᵀ with these values: their conversions serve every width
            t = graph.transpose()
            per[kind] = (DeviceCSR(graph.shape, graph.indptr, graph.indices, values.detach(),
                                   rows=graph.row_ids()),
                         DeviceCSR(t.csr.shape, t.csr.indptr, t.csr.indices,
                                   values.detach().index_select(0, t.perm),
                                   rows=t.csr.row_ids()))
        a, at = per[kind]
        fwd, fs = _layout(a, fmt, feat, tune)
        bwd, bs = _layout(at, fmt, feat, tune)
        hit = per[key] = GraphPlan(fwd, fs, bwd, bs, owned, next(_IDS))
        for dead in [k for k, ref in _BY_ID.items() if ref() is None]:
            del _BY_ID[dead]
        _BY_ID[hit.ident] = weakref.ref(hit)
    return hit


def _csr(indptr: Any, indices: Any, values: Any, rows: Any, n_cols: int) -> DeviceCSR:
    return DeviceCSR((int(indptr.shape[0]) - 1, n_cols), indptr, indices, values, rows=rows)


def _plan(plan: int) -> GraphPlan | None:
    ref = _BY_ID.get(abs(plan)) if plan else None
    return None if ref is None else ref()


def _run_spmm(x: Any, values: Any, indptr: Any, indices: Any, rows: Any, plan: int) -> Any:
    """Y = A X through plan ``plan``'s layout of A (+) or Aᵀ (-), else CSR from the tensors."""
    p = _plan(plan)
    if p is not None:
        m, sched = (p.fwd, p.fwd_schedule) if plan > 0 else (p.bwd, p.bwd_schedule)
        if m.shape == (int(indptr.shape[0]) - 1, int(x.shape[0])) and \
                m.nnz == int(indices.shape[0]):
            return spmm(m if p.owned else m.with_values(values), x, schedule=sched)
    return spmm(_csr(indptr, indices, values, rows, int(x.shape[0])), x)


@functools.lru_cache(maxsize=1)
def _ops() -> Any:
    """Register ``pitgen::graph_spmm`` (with autograd) and ``pitgen::graph_sddmm`` once."""
    import torch

    @torch.library.custom_op("pitgen::graph_sddmm", mutates_args=(), schema=SDDMM_SCHEMA)
    @on_operand_device
    def graph_sddmm_op(u, v, indptr, indices, rows):
        """E[p] = U[row(p)] . V[col(p)] over the pattern (indptr, indices) in CSR order."""
        a = _csr(indptr, indices, u.new_empty(indices.shape[0]), rows, int(v.shape[0]))
        return sddmm(a, u.contiguous(), v.contiguous())

    @graph_sddmm_op.register_fake
    def _(u, v, indptr, indices, rows):
        return u.new_empty(indices.shape[0])

    @torch.library.custom_op("pitgen::graph_spmm", mutates_args=(), schema=SPMM_SCHEMA)
    @on_operand_device
    def graph_spmm_op(x, values, indptr, indices, rows, t_indptr, t_indices, t_rows, t_perm,
                      inverse, plan):
        """Y = A X for A = (indptr, indices, values) with x.shape[0] columns."""
        return _run_spmm(x.contiguous(), values, indptr, indices, rows, plan)

    @graph_spmm_op.register_fake
    def _(x, values, indptr, indices, rows, t_indptr, t_indices, t_rows, t_perm, inverse, plan):
        return x.new_empty((indptr.shape[0] - 1, x.shape[1]))

    def setup_context(ctx, inputs, output):
        x, values, *graph, plan = inputs   # x only feeds dA: kept only when the values learn
        ctx.save_for_backward(x if values.requires_grad else None, values, *graph)
        ctx.plan = plan

    def backward(ctx, dy):
        x, values, *graph = ctx.saved_tensors
        dx = dv = None
        if ctx.needs_input_grad[0]:   # dX = Aᵀ dY: the same operator on the transpose
            dx = graph_spmm_op(dy.contiguous(), *_transposed(values, graph, ctx.plan))
        if ctx.needs_input_grad[1]:   # dA = dY Xᵀ sampled on A's pattern
            dv = graph_sddmm_op(dy, x, *graph[:3])
        return (dx, dv) + (None,) * (len(_GRAPH_ARGS) + 1)

    graph_spmm_op.register_autograd(backward, setup_context=setup_context)
    return graph_spmm_op


def _transposed(values: Any, graph: Any, plan: int) -> tuple:
    """``pitgen::graph_spmm``'s arguments after x for Aᵀ: the transpose's values (an
    aggregator's plan holds them: no gather; learnt values are gathered into Aᵀ's order), its
    tensors, A's, the swapped position maps and plan -plan."""
    indptr, indices, rows, t_indptr, t_indices, t_rows, t_perm, inverse = graph
    p = _plan(plan)
    vt = (p.bwd if plan > 0 else p.fwd).source.values if p is not None and p.owned \
        else values.index_select(0, t_perm)
    return (vt, t_indptr, t_indices, t_rows, indptr, indices, rows, inverse, t_perm, -plan)


def _spmm_direct(x: Any, values: Any, *rest: Any) -> Any:
    """``pitgen::graph_spmm`` without autograd (inside an autograd node; ``rest``: the op's
    arguments after values, the graph tensors and the plan): its implementation
    called directly on plain CUDA tensors outside tracing (the dispatcher's Python wrapper of a
    custom op cost ~0.2 ms of host time per call on the lent H200's host, session 34), the
    registered op otherwise (torch.compile, fake tensors)."""
    import torch
    if type(x) is torch.Tensor and x.is_cuda and not torch.compiler.is_compiling():
        return _run_spmm(x.contiguous(), values, *rest[:3], rest[-1])   # A's tensors, plan
    return _ops()(x.contiguous(), values, *rest)


def _graph_tensors(graph: DeviceCSR) -> tuple:
    t = graph.transpose()
    return (graph.indptr, graph.indices, graph.row_ids(), t.csr.indptr, t.csr.indices,
            t.csr.row_ids(), t.perm, t.inverse)


@on_operand_device
def graph_spmm(graph: DeviceCSR, x: Tensor, values: Tensor | None = None,
               format: str = DEFAULT_FORMAT, tune: bool = False) -> Tensor:
    """Y = A X [rows, F] with gradients to ``x`` and to ``values`` (edge values [nnz] in A's
    CSR order, ``graph.values`` when None), float32 or float16 with fp32 accumulation, A and Aᵀ
    in ``format`` (SAGE_FORMATS). The first call per graph and feature width builds Aᵀ and the
    layouts on the GPU (row statistics and conversions sync the host); later calls do not
    sync. ``tune``: with format "auto", a measured search when the tune cache has none."""
    return _graph_spmm(graph, x, values, format, owned=False, tune=tune)


def _graph_spmm(graph: DeviceCSR, x: Any, values: Any, fmt: str, owned: bool,
                tune: bool = False) -> Any:
    _check_graph(graph)
    _check_format(fmt)
    _check_tune(fmt, tune)
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
    feat = int(x.shape[1])
    if graph.shape[0] * feat > 2**31 - 1 or graph.shape[1] * feat > 2**31 - 1:
        raise ShapeError(f"graph_spmm operands of {max(graph.shape)} x {feat} exceed int32 "
                         f"indexing")
    values = values.contiguous()
    plan = _plan_ident(graph, values, feat, fmt, owned, tune, dtype)
    return _ops()(x, values, *_graph_tensors(graph), plan)


def _plan_ident(graph: DeviceCSR, values: Any, feat: int, fmt: str, owned: bool, tune: bool,
                dtype: str) -> int:
    """The SpMM plan of A and Aᵀ at ``feat`` features in ``fmt`` (its ident; 0: CSR, run from
    the graph's tensors after the cost model's check of it)."""
    if fmt != "csr" and feat > 0:
        return graph_plan(graph, values, feat, fmt, owned, tune).ident
    if feat > 0 and graph.nnz > 0:
        _check_csr(graph, feat, dtype)
    return 0


@on_operand_device
def aggregate(graph: DeviceCSR, x: Tensor, aggr: str = "mean",
              format: str = DEFAULT_FORMAT, tune: bool = False) -> Tensor:
    """The ``aggr`` ("mean" or "sum") of every node's neighbours' rows of ``x`` (the graph's
    own values are not used), with autograd to ``x``; A and Aᵀ in ``format`` (``tune``: with
    "auto", a measured search when the tune cache has none)."""
    _check_graph(graph)
    _check_aggr(aggr)
    check_tensor("x", x, VALUE_DTYPES, 2, (graph.shape[1], None), contiguous=False)
    vals = aggregation_values(graph, aggr, str(x.dtype).replace("torch.", ""))
    return _graph_spmm(graph, x, vals, format, owned=True, tune=tune)


#: DeviceCSR -> {(raw_key of x and the parameters, aggr, format, tune): sage_conv's launch
#: arguments (edge values, plan, graph tensors)}; dropped with the graph.
_LAYERS: "weakref.WeakKeyDictionary[DeviceCSR, dict]" = weakref.WeakKeyDictionary()
#: (device, dtype) -> a ones vector at least as long as any column sum's rows so far
_ONES: dict = {}


def _column_sum(dy: Any) -> Any:
    """dY summed over its rows (a bias gradient), for 64 columns or more as one matrix-vector
    product: torch's reduction over dim 0 of a tall [nodes, 128] matrix read it at ~1 TB/s
    (ogbn-arxiv, docs/sage.md); cuBLAS accumulates in float32 for float16 too. Narrower, cuBLAS
    runs two kernels (dot, then a reduce) where torch's reduction is one and as fast."""
    import torch
    if dy.shape[1] < 64:
        return dy.sum(0)
    key = (dy.device, dy.dtype)
    ones = _ONES.get(key)
    if ones is None or ones.shape[0] < dy.shape[0]:
        ones = _ONES[key] = torch.ones(max(dy.shape[0], 1024), dtype=dy.dtype, device=dy.device)
    return torch.mv(dy.t(), ones[:dy.shape[0]])


@functools.lru_cache(maxsize=1)
def _sage_function() -> type:
    """``SageConvFn``: one SAGEConv layer as one autograd node (built on first use)."""
    import torch
    from torch.autograd.function import once_differentiable

    class SageConvFn(torch.autograd.Function):
        """``act(aggr(x) W_lᵀ + b + x W_rᵀ)`` with the dense work around the aggregation fused:
        the root term and the neighbour term meet in cuBLAS's accumulating product (β = 1)
        instead of an add over [nodes, out], the bias rides in the first product, ReLU is
        applied in place, dX's two terms meet the same way, and the bias gradient is one
        matrix-vector product. Weight first when in > out (the narrower side is aggregated).
        Graph args: ``pitgen::graph_spmm``'s (values, A's and Aᵀ's tensors, plan)."""

        @staticmethod
        def forward(ctx, x, w_l, b, w_r, relu, values, plan, *graph):
            first = w_l.shape[0] < w_l.shape[1]
            agg = None
            if first:
                y = _spmm_direct(torch.mm(x, w_l.t()), values, *graph, plan)
                if w_r is not None:
                    y.addmm_(x, w_r.t())
                if b is not None:
                    y.add_(b)
            else:
                agg = _spmm_direct(x, values, *graph, plan)
                if w_r is None:
                    y = torch.mm(agg, w_l.t()) if b is None else torch.addmm(b, agg, w_l.t())
                else:
                    y = torch.mm(x, w_r.t()) if b is None else torch.addmm(b, x, w_r.t())
                    y.addmm_(agg, w_l.t())
            if relu:
                y.relu_()
            ctx.first, ctx.plan, ctx.relu = first, plan, relu
            ctx.save_for_backward(x, w_l, w_r, agg, y if relu else None, values, *graph)
            return y

        @staticmethod
        @once_differentiable
        def backward(ctx, dy):
            x, w_l, w_r, agg, y, values, *graph = ctx.saved_tensors
            need_x, need_wl, need_b, need_wr = ctx.needs_input_grad[:4]
            dy = dy.contiguous()
            if ctx.relu:
                dy = torch.ops.aten.threshold_backward(dy, y, 0)
            dx = dwl = db = dwr = None
            if need_b:
                db = _column_sum(dy)
            if ctx.first and w_r is not None and (need_wl or need_x):
                # y = A (x W_lᵀ) + x W_rᵀ + b, out < in: with G = [dY | Aᵀ dY] (narrow), one
                # product gives both weight gradients ([W_r; W_l]' = Gᵀ x) and one
                # dX = G [W_r; W_l] (each reads x or writes dX once, not twice)
                f_out = dy.shape[1]
                g = torch.cat((dy, _spmm_direct(dy, *_transposed(values, graph, ctx.plan))), 1)
                if need_wl or need_wr:
                    dw = torch.mm(g.t(), x)
                    dwr, dwl = (dw[:f_out] if need_wr else None), (dw[f_out:] if need_wl else None)
                if need_x:
                    dx = torch.mm(g, torch.cat((w_r, w_l)))
                return (dx, dwl, db, dwr) + (None,) * (3 + len(_GRAPH_ARGS))
            if need_wr:
                dwr = torch.mm(dy.t(), x)
            if ctx.first:   # y = A (x W_lᵀ) + ...: dP = Aᵀ dY
                if need_wl or need_x:
                    dp = _spmm_direct(dy, *_transposed(values, graph, ctx.plan))
                    if need_wl:
                        dwl = torch.mm(dp.t(), x)
                    if need_x:
                        dx = torch.mm(dp, w_l)
            else:           # y = (A x) W_lᵀ + ...: dX = Aᵀ (dY W_l)
                if need_wl:
                    dwl = torch.mm(dy.t(), agg)
                if need_x:
                    dx = _spmm_direct(torch.mm(dy, w_l), *_transposed(values, graph, ctx.plan))
            if need_x and w_r is not None:
                dx.addmm_(dy, w_r)
            return (dx, dwl, db, dwr) + (None,) * (3 + len(_GRAPH_ARGS))

    return SageConvFn


@on_operand_device
def sage_conv(graph: DeviceCSR, x: Tensor, w_l: Tensor, b: Tensor | None = None,
              w_r: Tensor | None = None, aggr: str = "mean", relu: bool = False,
              format: str = DEFAULT_FORMAT, tune: bool = False) -> Tensor:
    """One GraphSAGE layer, ``aggr_{j in N(i)} x_j W_lᵀ + b + x_i W_rᵀ`` (then ReLU with
    ``relu``), as one autograd node: gradients to x, the weights and the bias (the aggregation's
    values are the aggregator's: no gradient). W_l, W_r [out, in]; b [out]; all of x's dtype
    and device. A and Aᵀ in ``format`` as for :func:`aggregate`."""
    _check_graph(graph)
    _check_aggr(aggr)
    _check_format(format)
    _check_tune(format, tune)
    key = raw_key(x, w_l, b, w_r)
    vals, plan, tensors = validated(
        _LAYERS.setdefault(graph, {}), None if key is None else (key, aggr, format, tune),
        lambda: _layer_args(graph, x, w_l, b, w_r, aggr, format, tune))
    return _sage_function().apply(x.contiguous(), w_l, b, w_r, bool(relu), vals, plan, *tensors)


def _layer_args(graph: DeviceCSR, x: Any, w_l: Any, b: Any, w_r: Any, aggr: str, fmt: str,
                tune: bool) -> tuple:
    """sage_conv's checks, and its SpMM's arguments: the aggregator's edge values, the plan
    of A and Aᵀ at the narrower width (0: CSR), the graph's tensors. Memoised per call
    signature: a steady-state call repeats none of it."""
    check_tensor("x", x, VALUE_DTYPES, 2, (graph.shape[1], None), contiguous=False)
    dtype = str(x.dtype).replace("torch.", "")
    f_in = int(x.shape[1])
    check_tensor("w_l", w_l, (dtype,), 2, (None, f_in), contiguous=False)
    f_out = int(w_l.shape[0])
    if w_r is not None:
        check_tensor("w_r", w_r, (dtype,), 2, (f_out, f_in), contiguous=False)
    if b is not None:
        check_tensor("b", b, (dtype,), 1, (f_out,), contiguous=False)
    if graph.shape[0] != graph.shape[1] and w_r is not None:
        raise ShapeError(f"a root weight needs a square graph (one row per node), got "
                         f"{graph.shape}")
    vals = aggregation_values(graph, aggr, dtype)
    plan = _plan_ident(graph, vals, min(f_in, f_out), fmt, True, tune, dtype)
    return vals, plan, _graph_tensors(graph)


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
        ``lin_r.weight [out, in]`` (``root_weight=True``), PyG's names. ``forward(graph, x,
        relu=False)`` takes a DeviceCSR (row i: the nodes node i aggregates from) and x [nodes,
        in]; trains (gradients to x and every parameter) through one fused autograd node
        (:func:`sage_conv`; a subclass with another ``propagate`` runs PyG's order instead).
        With ``in > out`` the neighbour weight is applied before the aggregation (fewer
        features to gather; the same result: it is linear).
        ``format``: the layout of A and Aᵀ (SAGE_FORMATS; "auto" by default: the tune cache
        or the cost model, and with ``tune=True`` a measured search)."""

        def __init__(self, in_channels: int, out_channels: int, aggr: str = "mean",
                     root_weight: bool = True, bias: bool = True, device: Any = None,
                     dtype: Any = None, format: str = DEFAULT_FORMAT, tune: bool = False) -> None:
            super().__init__()
            for name, v in (("in_channels", in_channels), ("out_channels", out_channels)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ShapeError(f"{name} must be a positive integer, got {v!r}")
            self.in_channels, self.out_channels = in_channels, out_channels
            self.aggr = _check_aggr(aggr)
            self.format = _check_format(format)
            self.tune = _check_tune(format, tune)
            kw = {"device": device, "dtype": dtype}
            self.lin_l = nn.Linear(in_channels, out_channels, bias=bias, **kw)
            self.lin_r = nn.Linear(in_channels, out_channels, bias=False, **kw) \
                if root_weight else None

        def propagate(self, graph: Any, x: Any) -> Any:
            """The neighbour aggregation (pitgen's SpMM; the benchmark's peer overrides it)."""
            return aggregate(graph, x, self.aggr, self.format, self.tune)

        def forward(self, graph: Any, x: Any, relu: bool = False) -> Any:
            """The layer's output for ``x`` [nodes, in] (``relu``: then ReLU, fused)."""
            if x.dim() != 2 or x.shape[1] != self.in_channels:
                raise ShapeError(f"x must be [nodes, {self.in_channels}], got {tuple(x.shape)}")
            if type(self).propagate is SAGEConv.propagate:   # pitgen's aggregation: fused
                return sage_conv(graph, x, self.lin_l.weight, self.lin_l.bias,
                                 None if self.lin_r is None else self.lin_r.weight, self.aggr,
                                 relu, self.format, self.tune)
            # another aggregation (the benchmark's peers): PyG's order of operations
            if self.in_channels > self.out_channels:
                y = self.propagate(graph, torch.nn.functional.linear(x, self.lin_l.weight))
                if self.lin_l.bias is not None:
                    y = y + self.lin_l.bias
            else:
                y = self.lin_l(self.propagate(graph, x))
            if self.lin_r is not None:
                y = y + self.lin_r(x)
            return torch.relu(y) if relu else y

        def extra_repr(self) -> str:
            return (f"{self.in_channels}, {self.out_channels}, aggr={self.aggr!r}, "
                    f"root_weight={self.lin_r is not None}, format={self.format!r}"
                    f"{', tune=True' if self.tune else ''}")

    class GraphSAGE(nn.Module):
        """``layers`` SAGEConv layers (in -> hidden ... -> out), ReLU between them; ``conv``
        another SAGEConv class (the benchmark's peers)."""

        def __init__(self, in_channels: int, hidden: int, out_channels: int, layers: int = 2,
                     aggr: str = "mean", conv: type = SAGEConv, device: Any = None,
                     dtype: Any = None, format: str = DEFAULT_FORMAT, tune: bool = False) -> None:
            super().__init__()
            if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
                raise ShapeError(f"layers must be a positive integer, got {layers!r}")
            sizes = [in_channels] + [hidden] * (layers - 1) + [out_channels]
            self.convs = nn.ModuleList(conv(a, b, aggr, device=device, dtype=dtype,
                                            format=format, tune=tune)
                                       for a, b in zip(sizes, sizes[1:]))

        def forward(self, graph: Any, x: Any) -> Any:
            for i, conv in enumerate(self.convs):
                x = conv(graph, x, relu=i + 1 < len(self.convs))
            return x

    return {"SAGEConv": SAGEConv, "GraphSAGE": GraphSAGE}


__getattr__ = lazy_torch_classes(__name__, ("SAGEConv", "GraphSAGE"), _build_module_classes)
